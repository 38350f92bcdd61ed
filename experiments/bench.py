"""Side by side: mgloop's aggregation modes and the systems users would otherwise pick.

    python -m experiments.bench --models=mlp --towers=1,4 \
        --modes=ps_cpu,reduce_broadcast,single_device,mirrored_ctl,mirrored_fit,split_concat
    python -m experiments.bench --models=mlp \
        --modes=ring@2x2,reduce_broadcast@2x2,ring@2x1,multi_worker_mirrored@2x1,ring@4

Every selected system (experiments/bench_systems.py) runs the same model on
the same devices (--device_kind: logical CPU devices, or GPUs) and the same
global batch, each in its own worker process (experiments/bench_worker.py), so
each peak resident set is its own. `--modes` entries (experiments/bench_plan.py):
MODE runs on every T of --towers, MODE@T on T devices, MODE@WxT as W worker
processes of T devices each, with TF_CONFIG on loopback ports (mgloop's
cross-worker mode, or MultiWorkerMirroredStrategy: multi_worker_mirrored@WxT);
bad entries are refused with one line before any process starts. `--plugin=MODULE`
(repeatable) is imported here and in every worker first, so that an aggregation
method it registers can be named in `--modes`.

The workers are built once, then asked for one timed loop of `--steps` steps
at a time: `--warmup` untimed loops each (tracing, caches), then `--repeats`
rounds in which every system runs one loop, in an order rotated by one each
round, so that machine drift and position hit every system alike (benchlib.rounds,
as in every timing benchmark of experiments/). Only one system computes at any
moment; the W processes of a multi-worker system all receive each command and run
the loop together, its time being the chief's (experiments/bench_processes.py).

Reported per system: the split it ran on (W processes x T devices, read back
from the workers), median examples/sec over the repeats and its median
absolute deviation (MAD), the median step time, its ratio to
MirroredStrategy's custom loop with the same towers in total, to
MultiWorkerMirroredStrategy with the same workers, and to the single-device
step (same global batch), the peak resident set (ru_maxrss, summed over a
system's processes) and its ratio to the single-device run's, and the mean loss
of the first loop (every system starts from the same weights on the same
batches, so these agree for exact methods; a warning says when not; bench.json also has
every loop's, warm-up first, and each system's first step's). Before any loop every system
runs one step from the seed's weights on the first batch, and their losses must agree
within the float32 bound of check_first_steps, else the harness stops with one line naming
the system that disagrees (exit status 1); per one-process mgloop mode
measured with 1 and N towers, the speedup eps(N)/eps(1) and the efficiency
speedup/N (same global batch: on logical CPU devices sharing the same cores
the ideal speedup is 1, on N GPUs it is N). Outputs in --output_dir:
bench.json, bench.md and TensorBoard logs (one run per system with its hparams
and metrics, for the HParams dashboard; per-repeat examples/sec as scalars).
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile

from absl import app, flags, logging
import numpy as np

from experiments import bench_plan
from experiments import bench_processes
from experiments import bench_systems
from experiments import benchlib
from mgloop.errors import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

DEFAULT_DATASET = {"mlp": "synthetic", "cnn": "synthetic", "big_mlp": "random_binary",
                   "resnet20": "synthetic_cifar", "minigooglenet": "synthetic_cifar"}
DEFAULT_GLOBAL_BATCH = {"mlp": 128, "cnn": 128, "big_mlp": 512, "resnet20": 128,
                        "minigooglenet": 128}
MIRRORED = "mirrored_ctl"
MULTI_WORKER_MIRRORED = bench_systems.MULTI_WORKER_MIRRORED
SINGLE = bench_plan.SINGLE

_FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mlp"], "models to measure, one after another")
flags.DEFINE_list("towers", ["4"], "tower counts (devices of one process); every "
                  "multi-device system given without @ runs with each")
flags.DEFINE_list("modes", ["ps_cpu", "reduce_broadcast", "ring", SINGLE, MIRRORED,
                            "mirrored_fit", "split_concat"],
                  "mgloop --aggregation modes and baselines: "
                  f"{', '.join(bench_systems.BASELINES + bench_systems.MULTI_WORKER_BASELINES)}"
                  "; MODE@T runs MODE with T towers only (e.g. ps_cpu@1 for the speedup "
                  "without running every system on 1 tower); MODE@WxT runs W worker processes "
                  "of T devices each (e.g. ring@2x2, multi_worker_mirrored@2x1)")
flags.DEFINE_enum("device_kind", "cpu", bench_plan.DEVICE_KINDS,
                  "cpu: every process splits the host CPU into logical devices; gpu: a "
                  "process of T devices uses gpu:0..T-1 (a multi-worker system's worker w its "
                  "own GPUs w*T..w*T+T-1) and MirroredStrategy its default cross-device ops")
flags.DEFINE_integer("global_batch_size", None, "global batch of every system (default per "
                     f"model: {DEFAULT_GLOBAL_BATCH})")
flags.DEFINE_string("dataset", None, f"dataset (default per model: {DEFAULT_DATASET})")
flags.DEFINE_integer("steps", 20, "training steps per timed loop (mgloop's steps_per_loop, "
                     "the loops' tf.range length, fit's steps_per_execution)")
flags.DEFINE_integer("warmup", 2, "untimed loops per system before timing")
flags.DEFINE_integer("repeats", 7, "timed loops per system, interleaved")
flags.DEFINE_string("optimizer", "momentum", "optimizer of every system (mgloop's names)")
flags.DEFINE_float("learning_rate", 0.01, "learning rate of every system")
flags.DEFINE_enum("cross_device_ops", None, ["reduce_to_one", "hierarchical_copy", "default"],
                  "MirroredStrategy's cross-device ops (the baselines; default: reduce_to_one "
                  "with --device_kind=cpu, TensorFlow's default, NCCL, with gpu)")
flags.DEFINE_integer("pack_bytes", None, "mgloop's --pack_bytes for every mgloop system "
                     "(default: mgloop's): "
                     "gradients fused into buckets of about this size before the local "
                     "exchange (across workers mgloop always makes one collective per dtype)")
flags.DEFINE_integer("ordered_sum_bytes", None, "mgloop's --ordered_sum_bytes for every mgloop "
                     "system (default: mgloop's; 0: off)")
flags.DEFINE_integer("sufficient_factor_bytes", None, "mgloop's --sufficient_factor_bytes for "
                     "every mgloop system (default: mgloop's; 0: off)")
flags.DEFINE_bool("profile", False, "after timing, trace one loop of every system with "
                  "tf.profiler into <output_dir>/profile/<model>/<system>")
flags.DEFINE_string("output_dir", None, "bench.json, bench.md, tensorboard/ (default: a fresh "
                    "folder under the temp dir)")
flags.DEFINE_integer("seed", 0, "seed of data and initial weights")
flags.DEFINE_multi_string("link", [], "BANDWIDTH,LATENCY, e.g. 10gbit,10us (repeatable): "
                          "per mgloop system, the modelled exchange of its counted traffic "
                          "on such a network (mgloop/observe/link_model.py) and the measured step "
                          "plus it")
flags.DEFINE_multi_string("plugin", [], "a module to import in the harness and in every "
                          "worker before anything is built (e.g. one registering an aggregation "
                          "method that --modes then names); repeatable")


def safe(name: str) -> str:
    return name.replace(":", "_").replace("@", "_")


def mgloop_thresholds() -> dict[str, int | None]:
    """--ordered_sum_bytes and --sufficient_factor_bytes as given (None: mgloop's default)."""
    return {name: getattr(_FLAGS, name) for name in bench_systems.MGLOOP_THRESHOLDS}


def global_batch_of(model: str) -> int:
    return _FLAGS.global_batch_size or DEFAULT_GLOBAL_BATCH.get(model, 128)


def cross_device_ops() -> str:
    return _FLAGS.cross_device_ops or ("default" if _FLAGS.device_kind == "gpu"
                                       else "reduce_to_one")


def measure_model(model: str, output_dir: str, plan: list[bench_plan.Entry]) -> dict:
    dataset = _FLAGS.dataset or DEFAULT_DATASET.get(model, "synthetic")
    global_batch = global_batch_of(model)
    logical = max(entry.towers for entry in plan) if _FLAGS.device_kind == "cpu" else 1
    os.makedirs(os.path.join(output_dir, "workers"), exist_ok=True)
    systems = {}
    try:
        for entry in plan:
            spec = bench_systems.Spec(
                system=entry.system, model=model, dataset=dataset, towers=entry.towers,
                global_batch=global_batch, steps=_FLAGS.steps, seed=_FLAGS.seed,
                optimizer=_FLAGS.optimizer, learning_rate=_FLAGS.learning_rate,
                cross_device_ops=cross_device_ops(), workers=entry.workers,
                device_kind=_FLAGS.device_kind,
                plugins=tuple(_FLAGS.plugin), **mgloop_thresholds())
            systems[entry.name] = bench_processes.System(
                entry.name, spec.__dict__, entry.workers, logical,
                os.path.join(output_dir, "workers", f"{model}-{safe(entry.name)}"),
                _FLAGS.device_kind)
        ready = {name: system.receive() for name, system in systems.items()}
        logging.info("%s: %d systems built", model, len(systems))
        names = list(systems)
        # one step each from the seed's weights on the first batch, before any loop: the
        # systems must agree on its loss (they compute the same thing), else no timing
        first = {name: systems[name].ask("first_step") for name in names}
        agreement = check_first_steps(model, plan, first)
        losses = {name: [] for name in names}  # every loop's, warm-up first

        def loop(name):  # one timed loop in the system's workers: seconds per step
            reply = systems[name].ask("run")
            losses[name].append(reply["loss"])
            return reply["seconds"] / _FLAGS.steps
        times = benchlib.rounds({name: functools.partial(loop, name) for name in names},
                                _FLAGS.repeats, _FLAGS.warmup)
        if _FLAGS.profile:
            for name in names:
                systems[name].ask({"trace": os.path.join(output_dir, "profile", model,
                                                         safe(name))})
        stops = {name: systems[name].ask("stop") for name in names}
        peaks = {name: stops[name]["peak_rss_kib"] for name in names}
    finally:
        for system in systems.values():
            system.close()
    rows = []
    for entry in plan:
        name = entry.name
        devices = ready[name]["devices"]  # per process: what the system computes on
        split = f"{len(devices)}x{len(devices[0])}"
        if split != entry.split or any(len(d) != len(devices[0]) for d in devices):
            raise RuntimeError(f"{name} ran on {[len(d) for d in devices]} devices per process, "
                               f"not {entry.split}: {devices}")
        step_times = np.asarray(times[name])
        eps = global_batch / step_times
        eps_median, eps_mad = benchlib.median_and_mad(eps)
        step_median, step_mad = benchlib.median_and_mad(step_times)
        rows.append({
            "model": model, "name": name, "system": entry.system, "towers": entry.total_towers,
            "workers": entry.workers, "towers_per_worker": entry.towers, "split": split,
            "devices": devices,
            "kind": "mgloop" if entry.system.startswith(bench_systems.MGLOOP_PREFIX)
            else "baseline",
            "dataset": dataset, "global_batch": global_batch,
            "examples_per_sec": eps_median, "mad_examples_per_sec": eps_mad,
            "step_ms": 1e3 * step_median, "mad_step_ms": 1e3 * step_mad,
            "step_ms_repeats": [1e3 * t for t in step_times],
            "first_step_loss": first[name]["loss"],
            "first_loop_loss": losses[name][0], "loop_losses": losses[name],
            "build_seconds": ready[name]["build_seconds"],
            "baseline_rss_mib": ready[name]["baseline_rss_kib"] / 1024,
            "peak_rss_mib": peaks[name] / 1024,
            "optimizer_mib_per_device": (None if stops[name].get("optimizer_bytes") is None
                                         else stops[name]["optimizer_bytes"] / 2 ** 20)})
        rows[-1].update(link_figures(stops[name].get("traffic"), 1e3 * step_median))
    add_ratios(rows)
    check_first_losses(rows)
    return {"model": model, "dataset": dataset, "global_batch": global_batch, "rows": rows,
            "first_step_agreement": agreement, "speedup": speedups(rows)}


def links() -> list:
    from mgloop.observe import link_model
    return [link_model.parse(text) for text in _FLAGS.link]


def link_figures(traffic: dict | None, step_ms: float) -> dict:
    """--link, for an mgloop system (its chief's counted traffic): bytes per device and per
    link the modelled exchange, and the measured step plus it (no overlap) or the larger of
    the two (overlap). The measured step includes the exchange through shared memory, so
    these step figures are upper bounds (variants.py subtracts the exchange timed alone)."""
    if traffic is None or not _FLAGS.link:
        return {}
    from mgloop.observe import link_model
    counts = link_model.traffic_of(traffic["bytes"], traffic["messages"])
    out = {"bytes_per_device_kib": link_model.bytes_per_device(counts) / 1024,
           "traffic": traffic}
    for link in links():
        exchange_ms = 1e3 * link_model.exchange_seconds(counts, link)
        out[f"link_{link.tag}_exchange_ms"] = exchange_ms
        out[f"link_{link.tag}_step_ms"] = step_ms + exchange_ms
        out[f"link_{link.tag}_step_overlap_ms"] = max(step_ms, exchange_ms)
    return out


def link_columns() -> list[tuple[str, str, str]]:
    columns = [("bytes_per_device_kib", "bytes/device/step (KiB)", ".1f")] if _FLAGS.link else []
    for link in links():
        columns += [(f"link_{link.tag}_exchange_ms", f"modelled exchange at {link.name} (ms)",
                     ".3f"),
                    (f"link_{link.tag}_step_ms", f"step + exchange at {link.name} (ms)", ".2f"),
                    (f"link_{link.tag}_step_overlap_ms",
                     f"max(step, exchange) at {link.name} (ms)", ".2f")]
    return columns


U = 2.0 ** -24  # float32 unit roundoff


def gamma(n: int) -> float:
    """Higham's bound on the relative error of n rounded float32 operations: n u / (1 - n u)."""
    return n * U / (1 - n * U)


class LossMismatch(RuntimeError):
    """A system's first-step loss is not the others' (the message is one line)."""


def shards_of(entry: bench_plan.Entry) -> int:
    """How many parts a system splits each global batch into: its towers (all workers'),
    times K with mgloop's +kK (K towers per device)."""
    _, _, option = entry.system.partition("+")
    per_device = int(option[1:]) if option.startswith("k") and option[1:].isdigit() else 1
    return entry.total_towers * per_device


def check_first_steps(model: str, plan: list[bench_plan.Entry], first: dict[str, dict]) -> dict:
    """Every system's loss on its first step, the seed's initial weights on the first global
    batch, must be mgloop's (LossMismatch names the first that is not); returns n and the
    relative tolerance (bench.json's `first_step_agreement`).

    Why the first step and not the first loop: a lossy or local method (topk, signsgd,
    median, diloco, ...) legitimately trains otherwise from its first update on, and a
    later step's loss depends on every earlier update; the first step's depends on no update,
    only on how the system computes the mean loss over the global batch: the quantity
    compared, which no method changes. Reference: the first mgloop system of the plan, else
    single_device, else the first system.

    Tolerance: the systems compute the same real number, the mean over the B E values of
    the loss (E per example: the L tokens of a sequence) of the same model at the same
    weights on the same batch, in other float32 summation orders (the towers' shards, the
    kernels' blocking, the mean of the towers' means). Along any path that is at most n
    rounded additions (bench_systems.loss_terms: B E, the kernels' fan-ins, 2 E per
    attention layer, the K logits), each computation within gamma(n) of the exact mean
    relative to the magnitudes of its terms; cross-entropy values are >= 0, so that
    magnitude is the loss itself (tests/tolerance.py: "the mean loss of a step differs by
    at most 2 gamma(n) (1/B) sum_i |loss_i|"), and any two systems agree within

        2 gamma(n) |reference loss|

    e.g. transformer_lm on python_text at the harness's global batch of 128 (E = L = 64:
    n = 11392) 1.4e-3 relative, about 0.008 of its initial loss near log 256 = 5.5; with
    a global batch of 2 (tests/test_bench.py) n = 3328, 4e-4. A wrong reduction is far
    outside: a sum over the L tokens instead of their mean is L times the loss (the old
    MirroredStrategy baselines: 64 times), a missing 1/T T times, a tower's shard left out
    off by about 1/T of it.

    A model with batch norm normalises each tower's shard by its own statistics, so its
    loss depends on the split: then only systems with as many shards (shards_of) are compared.
    """
    n = max(reply["loss_terms"] for reply in first.values())
    bound = 2 * gamma(n)
    by_statistics = any(reply["batch_statistics"] for reply in first.values())
    groups: dict[int | None, list[bench_plan.Entry]] = {}
    for entry in plan:
        groups.setdefault(shards_of(entry) if by_statistics else None, []).append(entry)
    for shards, entries in groups.items():
        reference = next((e for e in entries if e.system.startswith(bench_systems.MGLOOP_PREFIX)),
                         next((e for e in entries if e.system == SINGLE), entries[0]))
        expected = first[reference.name]["loss"]
        for entry in entries:
            loss = first[entry.name]["loss"]
            if not abs(loss - expected) <= bound * abs(expected):  # NaN disagrees too
                split = "" if shards is None else f" (batch norm: systems of {shards} shards)"
                raise LossMismatch(
                    f"{model}: {entry.name} computes another loss: {loss:.6g} on its first "
                    f"step (the seed's weights, the first batch), {reference.name} "
                    f"{expected:.6g}; they must agree within 2 gamma(n) = {bound:.3g} relative "
                    f"(float32, n = {n} terms){split}")
        logging.info("%s: first-step loss %.6f agreed by %s within %.3g relative", model,
                     expected, ", ".join(e.name for e in entries), bound)
    return {"loss_terms": n, "rtol": bound}


def check_first_losses(rows: list[dict], rtol: float = 1e-3) -> None:
    """Every system starts from the seed's weights on the same batches: warns if the mean
    losses of their first loops disagree (then the systems do not compute the same thing)."""
    reference = rows[0]
    for row in rows[1:]:
        if abs(row["first_loop_loss"] - reference["first_loop_loss"]) > rtol * abs(
                reference["first_loop_loss"]):
            logging.warning("%s: first loop's loss %.6f, but %s's is %.6f", row["name"],
                            row["first_loop_loss"], reference["name"],
                            reference["first_loop_loss"])


def add_ratios(rows: list[dict]) -> None:
    """Step-time ratios to mirrored_ctl (same towers in total), to multi_worker_mirrored (same
    workers; multi-worker rows) and to single_device; memory ratio to single_device."""
    mirrored = {r["towers"]: r for r in rows if r["system"] == MIRRORED}
    # Mirrored's custom loop at its best: the faster of plain and +xla, per tower count
    best = {}
    for r in rows:
        if r["system"] in (MIRRORED, MIRRORED + bench_systems.XLA_SUFFIX):
            if r["towers"] not in best or r["step_ms"] < best[r["towers"]]["step_ms"]:
                best[r["towers"]] = r
    multi_worker = {r["workers"]: r for r in rows if r["system"] == MULTI_WORKER_MIRRORED}
    single = next((r for r in rows if r["system"] == SINGLE), None)
    for row in rows:
        base = mirrored.get(row["towers"])
        row["step_ratio_to_mirrored"] = row["step_ms"] / base["step_ms"] if base else None
        base = best.get(row["towers"])
        row["step_ratio_to_best_mirrored"] = row["step_ms"] / base["step_ms"] if base else None
        base = multi_worker.get(row["workers"]) if row["workers"] > 1 else None
        row["step_ratio_to_multi_worker_mirrored"] = (row["step_ms"] / base["step_ms"]
                                                      if base else None)
        row["step_ratio_to_single"] = row["step_ms"] / single["step_ms"] if single else None
        row["peak_rss_ratio_to_single"] = (row["peak_rss_mib"] / single["peak_rss_mib"]
                                           if single else None)


def speedups(rows: list[dict]) -> list[dict]:
    """Per one-process mgloop mode measured on 1 tower: speedup eps(T)/eps(1), efficiency
    speedup/T."""
    out = []
    alone = [r for r in rows if r["workers"] == 1]
    for row in alone:
        if row["kind"] != "mgloop" or row["towers"] == 1:
            continue
        one = next((r for r in alone if r["system"] == row["system"] and r["towers"] == 1),
                   None)
        if one is None:
            continue
        speedup = row["examples_per_sec"] / one["examples_per_sec"]
        out.append({"model": row["model"], "name": row["name"], "system": row["system"],
                    "towers": row["towers"], "speedup": speedup,
                    "efficiency": speedup / row["towers"]})
    return out


TABLE = [("name", "system", "s"), ("split", "processes x devices", "s"),
         ("examples_per_sec", "examples/sec (median)", ".0f"),
         ("mad_examples_per_sec", "± MAD", ".0f"), ("step_ms", "step (ms)", ".2f"),
         ("step_ratio_to_mirrored", "step ÷ mirrored_ctl", ".2f"),
         ("step_ratio_to_best_mirrored", "step ÷ best of mirrored_ctl(+xla)", ".2f"),
         ("step_ratio_to_multi_worker_mirrored", "step ÷ multi_worker_mirrored", ".2f"),
         ("step_ratio_to_single", "step ÷ single_device", ".2f"),
         ("peak_rss_mib", "peak RSS (MiB)", ".0f"),
         ("peak_rss_ratio_to_single", "RSS ÷ single_device", ".2f"),
         ("optimizer_mib_per_device", "optimizer state per device (MiB)", ".2f"),
         ("first_loop_loss", "loss, 1st loop", ".4f")]
SPEEDUP_TABLE = [("name", "mgloop mode", "s"), ("towers", "towers", "d"),
                 ("speedup", "speedup vs 1 tower", ".2f"), ("efficiency", "efficiency", ".2f")]


def markdown(results: list[dict], command: str) -> str:
    lines = [f"Command: `{command}`", ""]
    for result in results:
        lines += [f"### {result['model']} (dataset {result['dataset']}, global batch "
                  f"{result['global_batch']}, {_FLAGS.steps} steps per loop, {_FLAGS.repeats} "
                  f"interleaved repeats after {_FLAGS.warmup} warm-up loops)", "",
                  benchlib.markdown(result["rows"], TABLE + link_columns()), ""]
        if any(row["workers"] > 1 for row in result["rows"]):
            lines += ["WxT: W processes (workers, TF_CONFIG on loopback) of T devices each; a "
                      "multi-worker system's step time is its chief's, its RSS the sum over "
                      "its processes.", ""]
        if result["speedup"]:
            lines += [benchlib.markdown(result["speedup"], SPEEDUP_TABLE), ""]
    return "\n".join(lines)


def write_tensorboard(results: list[dict], logdir: str) -> None:
    """One run per system (<model>/<name>) with its hparams and metrics, for the HParams tab."""
    import tensorflow as tf
    from tensorboard.plugins.hparams import api as hp
    rows = [row for result in results for row in result["rows"]]
    params = {
        "model": hp.HParam("model", hp.Discrete(sorted({r["model"] for r in rows}))),
        "system": hp.HParam("system", hp.Discrete(sorted({r["system"] for r in rows}))),
        "towers": hp.HParam("towers", hp.Discrete(sorted({r["towers"] for r in rows}))),
        "workers": hp.HParam("workers", hp.Discrete(sorted({r["workers"] for r in rows}))),
        "global_batch": hp.HParam("global_batch",
                                  hp.Discrete(sorted({r["global_batch"] for r in rows}))),
        "steps_per_loop": hp.HParam("steps_per_loop", hp.Discrete([_FLAGS.steps])),
    }
    metrics = ["examples_per_sec", "mad_examples_per_sec", "step_ms", "step_ratio_to_mirrored",
               "step_ratio_to_multi_worker_mirrored", "step_ratio_to_single", "peak_rss_mib",
               "peak_rss_ratio_to_single", "first_loop_loss"] + [
                   key for key, _, _ in link_columns()]
    with tf.summary.create_file_writer(logdir).as_default():
        hp.hparams_config(hparams=list(params.values()),
                          metrics=[hp.Metric(m, display_name=m) for m in metrics])
    for row in rows:
        run = os.path.join(logdir, row["model"], safe(row["name"]))
        with tf.summary.create_file_writer(run).as_default():
            hp.hparams({params["model"]: row["model"], params["system"]: row["system"],
                        params["towers"]: row["towers"], params["workers"]: row["workers"],
                        params["global_batch"]: row["global_batch"],
                        params["steps_per_loop"]: _FLAGS.steps},
                       trial_id=f"{row['model']}/{row['name']}")
            for metric in metrics:
                if row.get(metric) is not None:
                    tf.summary.scalar(metric, row[metric], step=0)
            for repeat, step_ms in enumerate(row["step_ms_repeats"]):
                tf.summary.scalar("examples_per_sec_repeat",
                                  row["global_batch"] / (step_ms / 1e3), step=repeat)


def machine() -> dict:
    """benchlib's record of the machine, with its memory and the GPUs TensorFlow sees."""
    import tensorflow as tf
    with open("/proc/meminfo") as handle:
        total_kib = int(handle.readline().split()[1])
    return {**benchlib.machine(), "memory_gib": round(total_kib / 2 ** 20, 1),
            "gpus": len(tf.config.list_physical_devices("GPU"))}


def make_plan() -> list[bench_plan.Entry]:
    """The systems to measure, checked against the flags and this machine (PlanError)."""
    from mgloop import aggregation
    plan = bench_plan.entries(_FLAGS.modes, [int(t) for t in _FLAGS.towers],
                              {name: aggregation.get(name).capabilities.single_loss
                               for name in aggregation.names()})
    visible_gpus = 0
    if _FLAGS.device_kind == "gpu":
        import tensorflow as tf
        visible_gpus = len(tf.config.list_physical_devices("GPU"))
    bench_plan.check_devices(plan, _FLAGS.device_kind, visible_gpus)
    for model in _FLAGS.models:
        bench_plan.check_batch(plan, global_batch_of(model), model)
    return plan


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    try:
        benchlib.load_plugins(_FLAGS.plugin)  # its methods are valid --modes
        plan = make_plan()
        from mgloop.observe import link_model
        link_model.check_links(tuple(_FLAGS.link))
    except (bench_plan.PlanError, benchlib.PluginError, ConfigError) as error:  # before any
        # process starts
        print(f"bench.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    output_dir = _FLAGS.output_dir or tempfile.mkdtemp(prefix="mgloop-bench-")
    os.makedirs(output_dir, exist_ok=True)
    command = "python " + " ".join(sys.argv)
    try:
        results = [measure_model(model, output_dir, plan) for model in _FLAGS.models]
    except LossMismatch as error:  # the systems do not compute the same thing: no timing
        print(f"bench.py: error: {error}", file=sys.stderr)
        sys.exit(1)
    payload = {"command": command, "machine": machine(),
               "settings": {"steps": _FLAGS.steps, "warmup": _FLAGS.warmup,
                            "repeats": _FLAGS.repeats, "towers": [int(t) for t in _FLAGS.towers],
                            "modes": list(_FLAGS.modes), "optimizer": _FLAGS.optimizer,
                            "learning_rate": _FLAGS.learning_rate,
                            "cross_device_ops": cross_device_ops(),
                            "device_kind": _FLAGS.device_kind, "pack_bytes": _FLAGS.pack_bytes,
                            "plugins": list(_FLAGS.plugin), "links": list(_FLAGS.link),
                            **mgloop_thresholds()},
               "results": results}
    table = markdown(results, command)
    benchlib.write_json(os.path.join(output_dir, "bench.json"), payload)
    tmp = os.path.join(output_dir, ".bench.md.tmp")  # replaced at once, as the JSON
    with open(tmp, "w") as handle:
        handle.write(table + "\n")
    os.replace(tmp, os.path.join(output_dir, "bench.md"))
    write_tensorboard(results, os.path.join(output_dir, "tensorboard"))
    print(table)
    print(f"outputs in {output_dir}")


if __name__ == "__main__":
    app.run(main)
