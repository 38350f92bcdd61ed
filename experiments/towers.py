"""Many towers on few devices: what they cost, and the kernels and products behind it.

    python -m experiments.towers many --rounds=3 --json_out=experiments/many_towers.json
    python -m experiments.towers kernels          (the robust rules' kernels, before and now)
    python -m experiments.towers matmuls          (big_mlp's products on B rows and on T x B/T)

`many`: `--towers_per_device=K` against one device and against the tower loop, with the
ratios of the targets below. Every case trains the mlp on the synthetic dataset with a
global batch of 1024 and plain SGD, each in a fresh child process (so that each peak resident set is its
own), one case at a time; `--rounds` rounds run every case once each, in an order
rotated by one per round (experiments/benchlib.py), and each figure is the median over
the rounds. Per case:

  build s        from the Config to a built Trainer (template, copies, staging)
  trace s        the first loop of one step (tracing and compiling the step) minus one
                 timed step: "trace + build" is their sum
  step ms        the median step of `--loops` loops of `--steps` steps after a warm-up
  peak MB        the child's peak resident set (ru_maxrss)

and the ratios the targets are stated in, side by side from the same invocation: trace +
build of K = 64 over K = 4 (<= 1.5), the step of 64 towers over one device on the same
global batch (mean <= 2, median and Krum <= 4), and the peak of 64 towers over
2 x one device's peak plus the 64 towers' gradient copies (<= 1).

`kernels`: the robust rules' kernels on `--rows` rows of `--size` elements, in one
process, before and now alternately over `--rounds` rounds: the coordinate median by
tf.sort against the sorting network (XLA), and the T x T squared distances from
differences against the centred Gram matrix; with their largest relative difference.

`matmuls`: what remains of big_mlp's tower tax once its kernels are factored
(mgloop/step/sufficient_factors.py) is in the products every tower runs on its own rows:

- forward, z = x W on the first layer (W: 8000 x 4000): every tower reads W;
- backward, the input gradient of the second layer (W: 4000 x 2000) in
  TensorFlow's form dx = dz W^T (`transpose_b`) and in mgloop's (W dz^T)^T.

Each variant multiplies B = `--rows` rows at once, or `--towers` pieces of B/T rows built
in one tf.function so that they run concurrently as the towers' do; `--rounds` rounds side
by side. Ratios are to the same product's one-device row in TensorFlow's form.

(The replicated modes' update, Keras's against the fused kernel, and whole against
sharded: experiments/updates.py.)
"""

from __future__ import annotations

import json
import os
import resource
import time

from absl import app, flags

from experiments import benchlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", None, "rounds side by side (default: many 2, kernels 10, "
                     "matmuls 9)")
flags.DEFINE_integer("steps", 20, "many: steps per timed loop")
flags.DEFINE_integer("loops", 5, "many: timed loops per case in each child")
flags.DEFINE_integer("global_batch", 1024, "many: examples per step")
flags.DEFINE_list("cases", None, "many: only these cases (default: all)")
flags.DEFINE_string("child", None, "internal (many): run this case (JSON) and reply")
flags.DEFINE_integer("rows", None, "kernels: rows (towers; default 64); matmuls: B, the "
                     "global batch (default 512)")
flags.DEFINE_integer("size", 118_000, "kernels: elements per row")
flags.DEFINE_integer("towers", 4, "matmuls: T, pieces of B/T rows each")
flags.DEFINE_list("forward_kernel", ["8000", "4000"], "matmuls: m,n of the forward product's W")
flags.DEFINE_list("backward_kernel", ["4000", "2000"], "matmuls: m,n of the input gradient's W")
flags.DEFINE_string("json_out", None, "write the rows (with command, settings, machine) here")

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


def many_child(settings: dict) -> dict:
    from mgloop.cluster import devices
    devices.configure_logical_cpus(int(settings["devices"].split(":")[1]))
    start = time.perf_counter()
    trainer, batches = benchlib.build("mlp", FLAGS.global_batch, optimizer="sgd",
                                      learning_rate=0.01, steps_per_loop=FLAGS.steps,
                                      summary_every=0, log_every=0, **settings)
    build = time.perf_counter() - start
    first = benchlib.seconds(lambda: trainer.train_loop(batches, 1))  # traces, compiles
    trainer.train_loop(batches, FLAGS.steps)  # warm-up (the loop of `steps` traces once)
    loop = benchlib.timer(lambda: trainer.train_loop(batches, FLAGS.steps), FLAGS.steps)
    step = benchlib.median_and_mad([loop() for _ in range(FLAGS.loops)])[0]
    gradient_bytes = sum(4 * v.shape.num_elements() for v in trainer.copies[0].trainable)
    return {"build_s": build, "trace_s": max(first - step, 0.0), "step_ms": 1e3 * step,
            "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "gradient_mb": gradient_bytes / 2 ** 20, "towers": trainer.replicas.num_towers}


def many(args) -> None:
    del args
    if FLAGS.child:
        benchlib.child_reply(many_child(json.loads(FLAGS.child)))
        return
    names = FLAGS.cases or list(CASES)
    unknown = [name for name in names if name not in CASES]
    if unknown:
        raise app.UsageError(f"--cases: {unknown} not among {list(CASES)}")
    commands = {name: benchlib.child_command(
        __spec__.name, "many", f"--child={json.dumps(CASES[name])}", f"--steps={FLAGS.steps}",
        f"--loops={FLAGS.loops}", f"--global_batch={FLAGS.global_batch}")
        for name in names}
    samples = benchlib.in_children(commands, FLAGS.rounds, log=lambda r, name, figures: print(
        f"round {r + 1}: {name}: {figures}", flush=True))
    rows = benchlib.summarize(samples)
    for row in rows:
        row["trace_build_s"] = row["build_s"] + row["trace_s"]
    benchlib.add_ratio(rows, "step_ms", "one device", "step_vs_one")
    benchlib.add_ratio(rows, "trace_build_s", "K=4 mean", "trace_build_vs_k4")
    one = next((row for row in rows if row["case"] == "one device"), None)
    for row in rows:
        if one:
            allowed = 2 * one["peak_mb"] + row["towers"] * row["gradient_mb"]
            row["peak_vs_allowed"] = row["peak_mb"] / allowed
    benchlib.publish(
        f"mlp, global batch {FLAGS.global_batch}, SGD; medians over {FLAGS.rounds} rounds "
        f"of {FLAGS.loops} loops x {FLAGS.steps} steps", rows,
        [("case", "case", "s"), ("towers", "towers", ".0f"), ("build_s", "build s", ".2f"),
         ("trace_s", "trace s", ".2f"), ("trace_build_vs_k4", "trace+build / K=4", ".2f"),
         ("step_ms", "step ms", ".2f"), ("step_vs_one", "step / one device", ".2f"),
         ("peak_mb", "peak MB", ".0f"),
         ("peak_vs_allowed", "peak / (2 one + 64 grads)", ".2f")], FLAGS.json_out,
        {"rounds": FLAGS.rounds, "steps": FLAGS.steps, "loops": FLAGS.loops,
         "global_batch": FLAGS.global_batch, "cases": {name: CASES[name] for name in names}})


def kernels(args) -> None:
    del args
    import numpy as np
    import tensorflow as tf
    from mgloop.aggregation.kernels import sorting_network
    from mgloop.aggregation.robust import nnm
    rows = FLAGS.rows
    x = tf.random.normal([rows, FLAGS.size], seed=1)

    def sort_median(v):
        ordered = tf.sort(v, axis=0)
        return (ordered[rows // 2 - 1] + ordered[rows // 2]) * 0.5

    def differences(v):
        return tf.stack([tf.reduce_sum(tf.square(v - v[i]), axis=1) for i in range(rows)])
    pairs = {"median": (tf.function(sort_median), lambda v: sorting_network.medians([v])[0]),
             "distances": (tf.function(differences), tf.function(nnm.squared_distances))}
    out = []
    for name, (before, now) in pairs.items():
        a, b = before(x).numpy(), now(x).numpy()  # traced, compiled; and compared
        error = float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))
        samples = benchlib.rounds({f"{name}, before": benchlib.timer(lambda: before(x).numpy()),
                                   f"{name}, now": benchlib.timer(lambda: now(x).numpy())},
                                  FLAGS.rounds)
        pair = benchlib.summarize(samples, "kernel")
        benchlib.add_ratio(pair, "median", f"{name}, now", "times_now", name="kernel")
        for row in pair:
            row.update(ms=1e3 * row["median"], mad_ms=1e3 * row["mad"],
                       largest_relative_difference=error)
        out += pair
    benchlib.publish(
        f"{rows} rows x {FLAGS.size} elements, {FLAGS.rounds} rounds side by side", out,
        [("kernel", "kernel", "s"), ("ms", "median (ms)", ".1f"), ("mad_ms", "± MAD (ms)", ".1f"),
         ("times_now", "÷ now", ".1f"),
         ("largest_relative_difference", "largest relative difference", ".1e")],
        FLAGS.json_out, {"rows": rows, "size": FLAGS.size, "rounds": FLAGS.rounds})


def forms() -> dict:
    """form -> f(rows piece, kernel): "forward" is x W, "backward" forms dx from dz."""
    import tensorflow as tf
    return {
        "forward x W": lambda x, w: tf.matmul(x, w),
        "backward dz W^T (TensorFlow)": lambda dz, w: tf.matmul(dz, w, transpose_b=True),
        "backward (W dz^T)^T (mgloop)": lambda dz, w: tf.transpose(
            tf.matmul(w, dz, transpose_b=True)),
    }


BASELINES = {"forward": "forward x W", "backward": "backward dz W^T (TensorFlow)"}


def matmuls(args) -> None:
    del args
    import tensorflow as tf  # no logical devices to configure: the default CPU
    products = forms()
    shapes = {"forward": [int(d) for d in FLAGS.forward_kernel],
              "backward": [int(d) for d in FLAGS.backward_kernel]}
    weights = {kind: tf.Variable(tf.random.normal(shape, seed=1))
               for kind, shape in shapes.items()}
    inputs = {"forward": tf.random.normal([FLAGS.rows, shapes["forward"][0]], seed=2),
              "backward": tf.random.normal([FLAGS.rows, shapes["backward"][1]], seed=3)}

    def product(form, parts):
        kind = form.split()[0]

        @tf.function
        def run():
            return tf.add_n([tf.reduce_sum(products[form](piece, weights[kind]))
                             for piece in tf.split(inputs[kind], parts)])
        return run

    def name(form, parts):
        return f"{form}, {parts} x {FLAGS.rows // parts} rows"
    runs = {}
    for form in products:
        for parts in (1, FLAGS.towers):
            run = product(form, parts)
            runs[name(form, parts)] = benchlib.timer(lambda run=run: run().numpy())
    rows = benchlib.summarize(benchlib.rounds(runs, FLAGS.rounds, warmup=1), "product")
    for kind, form in BASELINES.items():
        mine = [row for row in rows if row["product"].startswith(kind)]
        benchlib.add_ratio(mine, "median", name(form, 1), name="product")
    for row in rows:
        row.update(ms=1e3 * row["median"], mad_ms=1e3 * row["mad"])
    benchlib.publish(
        f"forward W {'x'.join(FLAGS.forward_kernel)}, backward W "
        f"{'x'.join(FLAGS.backward_kernel)}; {FLAGS.rounds} rounds side by side", rows,
        [("product", "product", "s"), ("ms", "median (ms)", ".1f"),
         ("mad_ms", "± MAD (ms)", ".1f"),
         ("ratio", "ratio to one device's B rows, TensorFlow's form", ".2f")], FLAGS.json_out,
        {"rows": FLAGS.rows, "towers": FLAGS.towers, "rounds": FLAGS.rounds,
         "forward_kernel": FLAGS.forward_kernel, "backward_kernel": FLAGS.backward_kernel})


COMMANDS = {"many": (many, {"rounds": 2}),
            "kernels": (kernels, {"rounds": 10, "rows": 64}),
            "matmuls": (matmuls, {"rounds": 9, "rows": 512})}


if __name__ == "__main__":
    app.run(lambda argv: benchlib.dispatch(argv, COMMANDS))
