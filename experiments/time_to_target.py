"""Wall seconds to a target across a real shaped link, beside the modelled seconds of the
same runs.

    python -m experiments.time_to_target --json_out=experiments/time_to_target.json   (as root)

For every method of `--methods` and seed of `--seeds`: one job of `python -m mgloop.launch
--netns` (`--workers` workers of one CPU device, each in its own network namespace, both
ends of its link shaped by tc tbf to `--bandwidth`: mgloop/cluster/netns.py) that trains
`--model` on `--dataset` for `--steps` steps at `--learning_rate` (plain SGD), one step per
call with a summary each (`--steps_per_loop=1 --summary_every=1`), evaluated every
`--eval_every` steps by the chief on the model the method produces (DiLoCo's and
SparseLoCo's outer parameters, equal on every node). Per method one more job on loopback
(no --netns, seed 0) gives the compute C: its median step less its exchange timed alone
(link_check.py's unshaped job).

Per job, at the first eval step s* where `--target` holds (e.g. accuracy>=0.9):

    measured   the wall seconds of training to s*: the chief's train/step_time summed over
               steps 2..s*, and step 1 (which traces the step) counted as the median step
               (evaluations, start-up and the trace are not training time)
    modelled   s* (C + X), X the link model's exchange per step averaged over the run at
               the nominal link (--link=between:BANDWIDTH,0us; the job's summary.json), no
               overlap. Exact at s*: every eval step is a multiple of each method's period
               H (--eval_every is), so the steps to s* hold whole periods
    calibrated the same at the calibrated link (link_calibration.py fitted on
               `--calibration`, link_check.py's JSON: X = S / B' + alpha m)

The table: per method the seeds that reached the target, steps to it, measured, modelled
and calibrated seconds (mean +- sample sd over those seeds) and the ratios measured /
modelled. The ordering of the methods by time to target is the study's question: does
the link model rank them as the wall clock does? Jobs run one after another; run it alone
(the measured seconds are the machine's).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
import tempfile

from absl import app
from absl import flags

from experiments import benchlib
from experiments import link_calibration  # experiments/link_calibration.py
from experiments import link_check  # experiments/link_check.py: run_job, one_exchange, sync_rule
from mgloop.cluster import netns as netns_lib  # imports no TensorFlow
from mgloop.errors import ConfigError
from mgloop.observe import link_model  # imports no TensorFlow

FLAGS = flags.FLAGS
HERE = os.path.dirname(os.path.abspath(__file__))

METHODS = {  # label -> --aggregation spec: periods divide --eval_every
    "ring": "ring",
    "diloco": "diloco:period=16",
    "signsgd1": "signsgd:bits=1",
    "sparseloco": "sparseloco:period=16",
}
TARGET = re.compile(r"^(\w+)(<=|>=)([0-9.eE+-]+)$")


def define_flags() -> None:
    flags.DEFINE_list("methods", list(METHODS), f"labels: {', '.join(METHODS)}")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "the seeds of the shaped jobs")
    flags.DEFINE_integer("workers", 4, "worker processes, one CPU device each")
    flags.DEFINE_string("bandwidth", "10mbit", "every worker's link (tbf at both ends)")
    flags.DEFINE_integer("steps", 256, "training steps of every job")
    flags.DEFINE_integer("eval_every", 32, "steps between evaluations (a multiple of every "
                         "method's period)")
    flags.DEFINE_string("target", "accuracy>=0.9", "METRIC>=VALUE or METRIC<=VALUE of the "
                        "chief's evaluations")
    flags.DEFINE_string("model", "mlp", "--model of every job")
    flags.DEFINE_string("dataset", "digits", "--dataset of every job")
    flags.DEFINE_integer("global_batch", 128, "--global_batch_size of every job")
    flags.DEFINE_float("learning_rate", 0.1, "--learning_rate of every job (SGD)")
    flags.DEFINE_string("calibration", os.path.join(HERE, "link_check.json"),
                        "link_check.py's JSON whose cells calibrate the link")
    flags.DEFINE_float("timeout", 900.0, "seconds a job may run before it is stopped")
    flags.DEFINE_string("output_dir", None, "the jobs' logdirs (default: a temporary folder)")
    flags.DEFINE_string("json_out", None, "also write the results here as JSON")


def train_flags(spec: str, seed: int, logdir: str) -> list[str]:
    return [f"--model={FLAGS.model}", f"--dataset={FLAGS.dataset}", f"--aggregation={spec}",
            f"--seed={seed}", f"--train_steps={FLAGS.steps}",
            f"--global_batch_size={FLAGS.global_batch}", f"--learning_rate={FLAGS.learning_rate}",
            "--steps_per_loop=1", "--summary_every=1", "--log_every=0",
            f"--eval_every={FLAGS.eval_every}", "--checkpoint_every=0", f"--logdir={logdir}",
            "--link=within:100gbit,2us", f"--link=between:{FLAGS.bandwidth},0us"]


def run_job(netns: bool, train: list[str], folder: str) -> dict:
    """One launch of --workers workers of one CPU device (link_check.run_job)."""
    return link_check.run_job(FLAGS.workers, netns, train, folder, "cpu:1", FLAGS.timeout)


def evals(folder: str, metric: str) -> dict[int, float]:
    """{step: the chief's eval `metric`} from the event files in `folder`."""
    import tensorflow as tf
    from tensorflow.core.util import event_pb2
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("events"):
            for record in tf.data.TFRecordDataset(os.path.join(folder, name)):
                event = event_pb2.Event.FromString(record.numpy())
                for value in event.summary.value:
                    if value.tag == metric:
                        out[int(event.step)] = float(tf.make_ndarray(value.tensor))
    return out


def reached(points: dict[int, float], op: str, value: float) -> int | None:
    """The first eval step where the target holds, else None."""
    for step in sorted(points):
        if (points[step] >= value) if op == ">=" else (points[step] <= value):
            return step
    return None


def seconds_to(step: int, times: dict[int, float]) -> float:
    """Training seconds through `step`: step_time of steps 2..step, step 1 as the median."""
    return statistics.median(times.values()) + sum(t for g, t in times.items() if g <= step)


def exchange(summary: dict, link) -> float:
    """The link model's averaged exchange per step of a job's summary at `link`."""
    traffic = summary["link_model"]
    return link_check.one_exchange({"bytes_per_device": traffic["bytes_per_device"],
                                    "messages_per_device": traffic["messages_per_device"]}, link)


def mean_sd(values: list[float], digits: int = 2) -> str:
    """mean ± sample sd ("—" without values; sd 0 for one)."""
    if not values:
        return "—"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def refusal(bandwidth: str, methods: list[str], eval_every: int, numbers: dict,
            workers: int) -> str | None:
    """One line refusing the run before any job starts, or None: a bandwidth the link model
    or --netns refuses (not root, no ip/tc, ...), a value of `numbers` ({flag: value}) that
    is not finite and positive, or an --eval_every that is not a multiple of a method's
    period (the modelled seconds at an eval step are exact only over whole periods)."""
    try:
        link = link_model.parse(f"between:{bandwidth},0us")
    except ConfigError as error:
        return str(error)
    for name, number in numbers.items():
        if not math.isfinite(number) or number <= 0:
            return f"{name}={number}: give a finite number > 0"
    for label in methods:
        period = link_check.sync_rule(METHODS[label]).period
        if period and eval_every % period:
            return (f"--eval_every={eval_every} is not a multiple of {label}'s period "
                    f"{period}: give a multiple of every method's period")
    return netns_lib.refusal(workers, netns_lib.Shaping(link.bytes_per_second * 8, 0.0))


def main(argv):
    del argv
    match = TARGET.match(FLAGS.target)
    unknown = [label for label in FLAGS.methods if label not in METHODS]
    if not match or unknown:
        raise app.UsageError(f"--target={FLAGS.target} is not METRIC>=VALUE or METRIC<=VALUE"
                             if not match else f"--methods: {unknown} not among {list(METHODS)}")
    metric, op, value = match.group(1), match.group(2), float(match.group(3))
    problem = refusal(FLAGS.bandwidth, FLAGS.methods, FLAGS.eval_every, {
        "--learning_rate": FLAGS.learning_rate, "--timeout": FLAGS.timeout,
        "--steps": FLAGS.steps, "--eval_every": FLAGS.eval_every, "--workers": FLAGS.workers,
        "--global_batch": FLAGS.global_batch}, FLAGS.workers)
    if problem:
        print(f"time_to_target: error: {problem}", file=sys.stderr)
        return 2
    nominal = link_model.parse(f"between:{FLAGS.bandwidth},0us")
    with open(FLAGS.calibration) as handle:
        fitted = link_calibration.fit(json.load(handle)["rows"])
    calibrated = fitted.link(nominal.bytes_per_second)
    output = FLAGS.output_dir or tempfile.mkdtemp(prefix="time_to_target-")
    rows, runs = [], []
    for label in FLAGS.methods:
        spec = METHODS[label]
        folder = os.path.join(output, label, "unshaped")
        unshaped = run_job(False, train_flags(spec, 0, os.path.join(folder, "logdir")), folder)
        compute = (unshaped["summary"] or {}).get("link_model", {}).get("compute_seconds")
        print(f"{label} unshaped: exit {unshaped['exit_code']}, C = {compute}", flush=True)
        per_seed = []
        for seed in map(int, FLAGS.seeds):
            folder = os.path.join(output, label, f"seed{seed}")
            job = run_job(True, train_flags(spec, seed, os.path.join(folder, "logdir")), folder)
            run = {"method": label, "spec": spec, "seed": seed, "job": job, "compute": compute}
            if job["summary"] and compute is not None:
                points = evals(os.path.join(job["logdir"], "eval"), metric)
                times = job["step_times"]
                step = reached(points, op, value)
                run.update(evals=points, target_step=step)
                if step:
                    run.update(measured=seconds_to(step, times),
                               modelled=step * (compute + exchange(job["summary"], nominal)),
                               calibrated=step * (compute + exchange(job["summary"],
                                                                     calibrated)))
            print(f"{label} seed {seed}: exit {job['exit_code']}, target at "
                  f"{run.get('target_step')}, measured {run.get('measured')}, modelled "
                  f"{run.get('modelled')}, calibrated {run.get('calibrated')}", flush=True)
            per_seed.append(run)
            runs.append({k: v for k, v in run.items() if k != "job"} | {"job": {
                k: v for k, v in job.items() if k != "summary"}})
        hit = [r for r in per_seed if r.get("measured") is not None]
        rows.append({
            "method": label, "spec": spec, "reached": f"{len(hit)}/{len(per_seed)}",
            "steps": mean_sd([r["target_step"] for r in hit], 0),
            "measured": mean_sd([r["measured"] for r in hit]),
            "modelled": mean_sd([r["modelled"] for r in hit]),
            "calibrated": mean_sd([r["calibrated"] for r in hit]),
            "ratio": mean_sd([r["measured"] / r["modelled"] for r in hit]),
            "calibrated_ratio": mean_sd([r["measured"] / r["calibrated"] for r in hit])})
    columns = [("method", "method", ""), ("spec", "--aggregation", ""),
               ("reached", "reached", ""), ("steps", "steps to target", ""),
               ("measured", "wall s", ""), ("modelled", "modelled s", ""),
               ("ratio", "wall / modelled", ""), ("calibrated", "calibrated s", ""),
               ("calibrated_ratio", "wall / calibrated", "")]
    left = [name for run in runs for name in run["job"]["left_behind"]]
    header = (f"{FLAGS.model} on {FLAGS.dataset}, {FLAGS.workers} workers on {FLAGS.bandwidth} "
              f"(tbf), target {FLAGS.target} (evals every {FLAGS.eval_every} steps), SGD "
              f"lr {FLAGS.learning_rate}, global batch {FLAGS.global_batch}; calibrated link "
              f"between:{calibrated.name} ({fitted.describe()})")
    benchlib.publish(header, rows, columns, FLAGS.json_out, settings={
        "runs": runs, "target": FLAGS.target, "bandwidth": FLAGS.bandwidth,
        "workers": FLAGS.workers, "steps": FLAGS.steps, "eval_every": FLAGS.eval_every,
        "calibration": fitted.as_dict(), "namespaces_left": left})
    print("namespaces left: " + (", ".join(left) if left else "none"))
    return 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
