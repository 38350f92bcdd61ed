"""Many simulated towers on one CPU device: `--towers_per_device=K` against one device
and against the tower loop (issue 26's targets).

    python experiments/bench_many_towers.py --rounds=3 --output=experiments/many_towers.json
    python experiments/bench_many_towers.py --kernels     (the robust rules' kernels alone)

Every case trains the mlp on the synthetic dataset with a global batch of 1024 and plain
SGD, each in a fresh child process (so that each peak resident set is its own), one case
at a time (only one computes at any moment); `--rounds` rounds run every case once each,
in an order rotated by one per round, and each figure is the median over the rounds.
Per case:

  build s        from the Config to a built Trainer (template, copies, staging)
  trace s        the first loop of one step (tracing and compiling the step) minus one
                 timed step: "trace + build" is their sum
  step ms        the median step of `--repeats` loops of `--steps` steps after a warm-up
  peak MB        the child's peak resident set (ru_maxrss)

and the ratios the targets are stated in, side by side from the same invocation: trace +
build of K = 64 over K = 4 (<= 1.5), the step of 64 towers over one device on the same
global batch (mean <= 2, median and Krum <= 4), and the peak of 64 towers over
2 x one device's peak plus the 64 towers' gradient copies (<= 1).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 2, "rounds over every case (each case once per round)")
flags.DEFINE_integer("steps", 20, "steps per timed loop")
flags.DEFINE_integer("repeats", 5, "timed loops per case and round")
flags.DEFINE_integer("global_batch", 1024, "examples per step")
flags.DEFINE_list("cases", None, "only these cases (default: all)")
flags.DEFINE_string("output", None, "write the rows as JSON here")
flags.DEFINE_bool("kernels", False, "instead: time the robust rules' kernels on 64 rows of "
                  "118k elements side by side (tf.sort against the sorting network; the "
                  "distances by differences against the Gram matrix)")
flags.DEFINE_string("child", None, "internal: run this case (JSON) and print its figures")

# name -> Config settings; devices cpu:D, K towers per device
CASES = {
    "one device": dict(devices="cpu:1", aggregation="ps_cpu"),
    "K=4 mean": dict(devices="cpu:1", towers_per_device=4, aggregation="ps_cpu"),
    "K=64 mean": dict(devices="cpu:1", towers_per_device=64, aggregation="ps_cpu"),
    "K=64 median": dict(devices="cpu:1", towers_per_device=64, aggregation="median"),
    "K=64 krum": dict(devices="cpu:1", towers_per_device=64, aggregation="krum:f=8"),
    "K=64 trimmed mean": dict(devices="cpu:1", towers_per_device=64,
                              aggregation="trimmed_mean:trim=8"),
    "64 devices, tower loop, mean": dict(devices="cpu:64", aggregation="ps_cpu"),
    "8 nodes x 16 towers, median": dict(devices="cpu:8", towers_per_device=16, nodes=8,
                                        aggregation="median"),
}


def child(settings: dict) -> dict:
    from experiments import benchlib
    from mgloop.cluster import devices
    devices.configure_logical_cpus(int(settings["devices"].split(":")[1]))
    start = time.perf_counter()
    trainer, batches = benchlib.build("mlp", FLAGS.global_batch, optimizer="sgd",
                                      learning_rate=0.01, steps_per_loop=FLAGS.steps,
                                      summary_every=0, log_every=0, **settings)
    build = time.perf_counter() - start
    start = time.perf_counter()
    trainer.train_loop(batches, 1)  # traces and compiles the step
    first = time.perf_counter() - start
    trainer.train_loop(batches, FLAGS.steps)  # warm-up (the loop of `steps` traces once)
    times = []
    for _ in range(FLAGS.repeats):
        start = time.perf_counter()
        trainer.train_loop(batches, FLAGS.steps)
        times.append((time.perf_counter() - start) / FLAGS.steps)
    step = benchlib.median_and_mad(times)[0]
    gradient_bytes = sum(4 * v.shape.num_elements() for v in trainer.copies[0].trainable)
    return {"build_s": build, "trace_s": max(first - step, 0.0), "step_ms": 1e3 * step,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "gradient_mb": gradient_bytes / 2 ** 20, "towers": trainer.replicas.num_towers}


def run_case(name: str) -> dict:
    command = [sys.executable, os.path.abspath(__file__), f"--child={json.dumps(CASES[name])}",
               f"--steps={FLAGS.steps}", f"--repeats={FLAGS.repeats}",
               f"--global_batch={FLAGS.global_batch}"]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"case {name!r} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def median(values):
    import numpy as np
    return float(np.median(values))


def kernels(rows: int = 64, size: int = 118_000, repeats: int = 10) -> None:
    """Median by tf.sort against the sorting network (XLA), and the T x T squared distances
    from differences against the centred Gram matrix, timed alternately in one process."""
    import numpy as np
    import tensorflow as tf
    from mgloop.aggregation import nnm, sorting_network
    x = tf.random.normal([rows, size], seed=1)

    def sort_median(v):
        ordered = tf.sort(v, axis=0)
        return (ordered[rows // 2 - 1] + ordered[rows // 2]) * 0.5

    def differences(v):
        return tf.stack([tf.reduce_sum(tf.square(v - v[i]), axis=1) for i in range(rows)])
    pairs = {"median": (tf.function(sort_median), lambda v: sorting_network.medians([v])[0]),
             "distances": (tf.function(differences), tf.function(nnm.squared_distances))}
    for name, (before, after) in pairs.items():
        a, b = before(x).numpy(), after(x).numpy()  # traced, compiled; and compared
        error = float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))
        times = {0: [], 1: []}
        for _ in range(repeats):
            for which, f in enumerate((before, after)):
                start = time.perf_counter()
                f(x).numpy()
                times[which].append(time.perf_counter() - start)
        t0, t1 = (1e3 * float(np.median(times[w])) for w in (0, 1))
        print(f"{name}: {t0:.1f} ms before, {t1:.1f} ms now, {t0 / t1:.1f}x faster "
              f"(largest relative difference {error:.1e})", flush=True)


def main(argv):
    del argv
    if FLAGS.kernels:
        kernels()
        return
    if FLAGS.child:
        print(json.dumps(child(json.loads(FLAGS.child))), flush=True)
        return
    names = FLAGS.cases or list(CASES)
    runs = {name: [] for name in names}
    for r in range(FLAGS.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            runs[name].append(run_case(name))
            print(f"round {r + 1}: {name}: {runs[name][-1]}", flush=True)
    rows = []
    for name in names:
        row = {"case": name, **{k: median([run[k] for run in runs[name]])
                                for k in runs[name][0]}}
        row["trace_build_s"] = row["build_s"] + row["trace_s"]
        rows.append(row)
    by = {row["case"]: row for row in rows}
    one = by.get("one device")
    for row in rows:
        if one:
            row["step_vs_one"] = row["step_ms"] / one["step_ms"]
            allowed = 2 * one["peak_mb"] + row["towers"] * row["gradient_mb"]
            row["peak_vs_allowed"] = row["peak_mb"] / allowed
        if "K=4 mean" in by:
            row["trace_build_vs_k4"] = row["trace_build_s"] / by["K=4 mean"]["trace_build_s"]
    from experiments import benchlib
    benchlib.report(
        f"mlp, global batch {FLAGS.global_batch}, SGD; medians over {FLAGS.rounds} rounds "
        f"of {FLAGS.repeats} loops x {FLAGS.steps} steps", rows,
        [("case", "case", "s"), ("towers", "towers", ".0f"), ("build_s", "build s", ".2f"),
         ("trace_s", "trace s", ".2f"), ("trace_build_vs_k4", "trace+build / K=4", ".2f"),
         ("step_ms", "step ms", ".2f"), ("step_vs_one", "step / one device", ".2f"),
         ("peak_mb", "peak MB", ".0f"),
         ("peak_vs_allowed", "peak / (2 one + 64 grads)", ".2f")], FLAGS.output)


if __name__ == "__main__":
    app.run(main)
