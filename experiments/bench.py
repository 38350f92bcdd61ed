"""Side by side: mgloop's aggregation modes and the systems users would otherwise pick.

    python experiments/bench.py --models=mlp --towers=1,4 \
        --modes=ps_cpu,reduce_broadcast,single_device,mirrored_ctl,mirrored_fit,split_concat

Every selected system (experiments/bench_systems.py) runs the same model on
the same logical CPU devices and the same global batch, each in its own
worker process (experiments/bench_worker.py), so each peak resident set is
its own. The workers are built once, then asked for one timed loop of
`--steps` steps at a time: `--warmup` untimed loops each (tracing, caches),
then `--repeats` rounds in which every system runs one loop, in an order
rotated by one each round, so that machine drift and position hit every
system alike. Only one worker computes at any moment.

Reported per system: median examples/sec over the repeats and its median
absolute deviation (MAD), the median step time, its ratio to
MirroredStrategy's custom loop with the same towers and to the single-device
step (same global batch), the peak resident set (ru_maxrss) and its ratio to
the single-device run's; per mgloop mode measured with 1 and N towers, the
speedup eps(N)/eps(1) and the efficiency speedup/N (same global batch: on
logical CPU devices sharing the same cores the ideal speedup is 1, on N
GPUs it is N). Outputs in --output_dir: bench.json, bench.md and TensorBoard
logs (one run per system with its hparams and metrics, for the HParams
dashboard; per-repeat examples/sec as scalars).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from absl import app, flags, logging  # noqa: E402
import numpy as np  # noqa: E402

import bench_systems  # noqa: E402
import benchlib  # noqa: E402

DEFAULT_DATASET = {"mlp": "synthetic", "cnn": "synthetic", "big_mlp": "random_binary",
                   "resnet20": "synthetic_cifar", "minigooglenet": "synthetic_cifar"}
DEFAULT_GLOBAL_BATCH = {"mlp": 128, "cnn": 128, "big_mlp": 512, "resnet20": 128,
                        "minigooglenet": 128}
MIRRORED = "mirrored_ctl"
SINGLE = "single_device"

_FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mlp"], "models to measure, one after another")
flags.DEFINE_list("towers", ["4"], "tower counts (logical CPU devices); every multi-device "
                  "system runs with each")
flags.DEFINE_list("modes", ["ps_cpu", "reduce_broadcast", "ring", SINGLE, MIRRORED,
                            "mirrored_fit", "split_concat"],
                  "mgloop --aggregation modes and baselines: "
                  f"{', '.join(bench_systems.BASELINES)}; MODE@T runs MODE with T towers only "
                  "(e.g. ps_cpu@1 for the speedup without running every system on 1 tower)")
flags.DEFINE_integer("global_batch_size", None, "global batch of every system (default per "
                     f"model: {DEFAULT_GLOBAL_BATCH})")
flags.DEFINE_string("dataset", None, f"dataset (default per model: {DEFAULT_DATASET})")
flags.DEFINE_integer("steps", 20, "training steps per timed loop (mgloop's steps_per_loop, "
                     "the loops' tf.range length, fit's steps_per_execution)")
flags.DEFINE_integer("warmup", 2, "untimed loops per system before timing")
flags.DEFINE_integer("repeats", 7, "timed loops per system, interleaved")
flags.DEFINE_string("optimizer", "momentum", "optimizer of every system (mgloop's names)")
flags.DEFINE_float("learning_rate", 0.01, "learning rate of every system")
flags.DEFINE_enum("cross_device_ops", "reduce_to_one", ["reduce_to_one", "hierarchical_copy"],
                  "MirroredStrategy's cross-device ops (the baselines)")
flags.DEFINE_bool("profile", False, "after timing, trace one loop of every system with "
                  "tf.profiler into <output_dir>/profile/<model>/<system>")
flags.DEFINE_string("output_dir", None, "bench.json, bench.md, tensorboard/ (default: a fresh "
                    "folder under the temp dir)")
flags.DEFINE_integer("seed", 0, "seed of data and initial weights")


class Worker:
    """One system's worker process; `ask` sends a command and waits for its reply."""

    def __init__(self, name: str, spec: bench_systems.Spec, logical_devices: int, log_path: str):
        self.name = name
        self.log_path = log_path
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "bench_worker.py")], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, text=True, env=env, cwd=ROOT)
        self._send({"spec": spec.__dict__, "logical_devices": logical_devices})

    def _send(self, command) -> None:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def receive(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("@@bench "):
                reply = json.loads(line[len("@@bench "):])
                if "error" in reply:
                    raise RuntimeError(f"{self.name}: {reply['error']}\n{reply['traceback']}")
                return reply
        self.process.wait()
        with open(self.log_path) as handle:
            tail = handle.read()[-3000:]
        raise RuntimeError(f"{self.name}: worker exited ({self.process.returncode}): {tail}")

    def ask(self, command) -> dict:
        self._send(command)
        return self.receive()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._log.close()


def system_names(modes: list[str], towers: list[int]) -> list[tuple[str, str, int]]:
    """(name, system, towers) of every system: the single-device step once, the others per T."""
    out = []
    for entry in modes:
        mode, _, only = entry.partition("@")
        system = mode if mode in bench_systems.BASELINES else bench_systems.MGLOOP_PREFIX + mode
        if mode == SINGLE:
            out.append((SINGLE, SINGLE, 1))
            continue
        for count in ([int(only)] if only else towers):
            out.append((f"{system}@{count}", system, count))
    return out


def measure_model(model: str, output_dir: str) -> dict:
    dataset = _FLAGS.dataset or DEFAULT_DATASET.get(model, "synthetic")
    global_batch = _FLAGS.global_batch_size or DEFAULT_GLOBAL_BATCH.get(model, 128)
    towers = [int(t) for t in _FLAGS.towers]
    systems = system_names(_FLAGS.modes, towers)
    logical = max(count for _, _, count in systems)
    os.makedirs(os.path.join(output_dir, "workers"), exist_ok=True)
    workers = {}
    try:
        for name, system, count in systems:
            spec = bench_systems.Spec(system=system, model=model, dataset=dataset, towers=count,
                                      global_batch=global_batch, steps=_FLAGS.steps,
                                      seed=_FLAGS.seed, optimizer=_FLAGS.optimizer,
                                      learning_rate=_FLAGS.learning_rate,
                                      cross_device_ops=_FLAGS.cross_device_ops)
            log = os.path.join(output_dir, "workers",
                               f"{model}-{name.replace(':', '_').replace('@', '_')}.log")
            workers[name] = Worker(name, spec, logical, log)
        ready = {name: worker.receive() for name, worker in workers.items()}
        logging.info("%s: %d systems built", model, len(workers))
        names = list(workers)
        for _ in range(_FLAGS.warmup):
            for name in names:
                workers[name].ask("run")
        times = {name: [] for name in names}
        for repeat in range(_FLAGS.repeats):
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(workers[name].ask("run")["seconds"] / _FLAGS.steps)
        if _FLAGS.profile:
            for name in names:
                trace_dir = os.path.join(output_dir, "profile", model,
                                         name.replace(":", "_").replace("@", "_"))
                workers[name].ask({"trace": trace_dir})
        peaks = {name: workers[name].ask("stop")["peak_rss_kib"] for name in names}
    finally:
        for worker in workers.values():
            worker.close()
    rows = []
    for name, system, count in systems:
        step_times = np.asarray(times[name])
        eps = global_batch / step_times
        eps_median, eps_mad = benchlib.median_and_mad(eps)
        step_median, step_mad = benchlib.median_and_mad(step_times)
        rows.append({
            "model": model, "name": name, "system": system, "towers": count,
            "kind": "mgloop" if system.startswith(bench_systems.MGLOOP_PREFIX) else "baseline",
            "dataset": dataset, "global_batch": global_batch,
            "examples_per_sec": eps_median, "mad_examples_per_sec": eps_mad,
            "step_ms": 1e3 * step_median, "mad_step_ms": 1e3 * step_mad,
            "step_ms_repeats": [1e3 * t for t in step_times],
            "build_seconds": ready[name]["build_seconds"],
            "baseline_rss_mib": ready[name]["baseline_rss_kib"] / 1024,
            "peak_rss_mib": peaks[name] / 1024})
    add_ratios(rows)
    return {"model": model, "dataset": dataset, "global_batch": global_batch, "rows": rows,
            "speedup": speedups(rows, towers)}


def add_ratios(rows: list[dict]) -> None:
    """Step-time ratios to mirrored_ctl (same towers) and single_device; memory ratio to single."""
    mirrored = {r["towers"]: r for r in rows if r["system"] == MIRRORED}
    single = next((r for r in rows if r["system"] == SINGLE), None)
    for row in rows:
        base = mirrored.get(row["towers"])
        row["step_ratio_to_mirrored"] = row["step_ms"] / base["step_ms"] if base else None
        row["step_ratio_to_single"] = row["step_ms"] / single["step_ms"] if single else None
        row["peak_rss_ratio_to_single"] = (row["peak_rss_mib"] / single["peak_rss_mib"]
                                           if single else None)


def speedups(rows: list[dict], towers: list[int]) -> list[dict]:
    """Per mgloop mode measured on 1 tower: speedup eps(T)/eps(1) and efficiency speedup/T."""
    out = []
    for row in rows:
        if row["kind"] != "mgloop" or row["towers"] == 1:
            continue
        one = next((r for r in rows if r["system"] == row["system"] and r["towers"] == 1), None)
        if one is None:
            continue
        speedup = row["examples_per_sec"] / one["examples_per_sec"]
        out.append({"model": row["model"], "system": row["system"], "towers": row["towers"],
                    "speedup": speedup, "efficiency": speedup / row["towers"]})
    return out


TABLE = [("name", "system", "s"), ("examples_per_sec", "examples/sec (median)", ".0f"),
         ("mad_examples_per_sec", "± MAD", ".0f"), ("step_ms", "step (ms)", ".2f"),
         ("step_ratio_to_mirrored", "step ÷ mirrored_ctl", ".2f"),
         ("step_ratio_to_single", "step ÷ single_device", ".2f"),
         ("peak_rss_mib", "peak RSS (MiB)", ".0f"),
         ("peak_rss_ratio_to_single", "RSS ÷ single_device", ".2f")]
SPEEDUP_TABLE = [("system", "mgloop mode", "s"), ("towers", "towers", "d"),
                 ("speedup", "speedup vs 1 tower", ".2f"), ("efficiency", "efficiency", ".2f")]


def markdown(results: list[dict], command: str) -> str:
    lines = [f"Command: `{command}`", ""]
    for result in results:
        lines += [f"### {result['model']} (dataset {result['dataset']}, global batch "
                  f"{result['global_batch']}, {_FLAGS.steps} steps per loop, {_FLAGS.repeats} "
                  f"interleaved repeats after {_FLAGS.warmup} warm-up loops)", "",
                  benchlib.markdown(result["rows"], TABLE), ""]
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
        "global_batch": hp.HParam("global_batch",
                                  hp.Discrete(sorted({r["global_batch"] for r in rows}))),
        "steps_per_loop": hp.HParam("steps_per_loop", hp.Discrete([_FLAGS.steps])),
    }
    metrics = ["examples_per_sec", "mad_examples_per_sec", "step_ms", "step_ratio_to_mirrored",
               "step_ratio_to_single", "peak_rss_mib", "peak_rss_ratio_to_single"]
    with tf.summary.create_file_writer(logdir).as_default():
        hp.hparams_config(hparams=list(params.values()),
                          metrics=[hp.Metric(m, display_name=m) for m in metrics])
    for row in rows:
        run = os.path.join(logdir, row["model"], row["name"].replace(":", "_").replace("@", "_"))
        with tf.summary.create_file_writer(run).as_default():
            hp.hparams({params["model"]: row["model"], params["system"]: row["system"],
                        params["towers"]: row["towers"],
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
    import keras
    import tensorflow as tf
    with open("/proc/meminfo") as handle:
        total_kib = int(handle.readline().split()[1])
    return {"cpus": os.cpu_count(), "memory_gib": round(total_kib / 2 ** 20, 1),
            "platform": platform.platform(), "python": platform.python_version(),
            "tensorflow": tf.__version__, "keras": keras.__version__,
            "gpus": len(tf.config.list_physical_devices("GPU")),
            "load_average": os.getloadavg(), "date": datetime.datetime.now().isoformat()}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from mgloop import aggregation
    for mode in (entry.partition("@")[0] for entry in _FLAGS.modes):
        if mode not in bench_systems.BASELINES and mode not in aggregation.names():
            raise app.UsageError(f"--modes: {mode!r} is neither an mgloop aggregation "
                                 f"({', '.join(aggregation.names())}) nor a baseline "
                                 f"({', '.join(bench_systems.BASELINES)})")
    output_dir = _FLAGS.output_dir or tempfile.mkdtemp(prefix="mgloop-bench-")
    os.makedirs(output_dir, exist_ok=True)
    command = "python " + " ".join(sys.argv)
    results = [measure_model(model, output_dir) for model in _FLAGS.models]
    payload = {"command": command, "machine": machine(),
               "settings": {"steps": _FLAGS.steps, "warmup": _FLAGS.warmup,
                            "repeats": _FLAGS.repeats, "towers": [int(t) for t in _FLAGS.towers],
                            "modes": list(_FLAGS.modes), "optimizer": _FLAGS.optimizer,
                            "learning_rate": _FLAGS.learning_rate,
                            "cross_device_ops": _FLAGS.cross_device_ops},
               "results": results}
    table = markdown(results, command)
    for name, text in (("bench.json", json.dumps(payload, indent=2)), ("bench.md", table)):
        tmp = os.path.join(output_dir, f".{name}.tmp")
        with open(tmp, "w") as handle:
            handle.write(text + "\n")
        os.replace(tmp, os.path.join(output_dir, name))
    write_tensorboard(results, os.path.join(output_dir, "tensorboard"))
    print(table)
    print(f"outputs in {output_dir}")


if __name__ == "__main__":
    app.run(main)
