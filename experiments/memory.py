"""Host memory that grows: per summary write, and a sweep's peak against its largest variant.

    python -m experiments.memory summary_writes --writes=4000 [--variants=eager,compiled,...]
    python -m experiments.memory sweep --output_dir=/tmp/sweep_memory
    python -m experiments.memory variables --writes=1000 --warmup=200

(a quick check that each runs: `summary_writes --writes=200 --warmup=100`, `sweep
--methods=ring,topk:ratio=0.01 --steps=4`.) The long runs, every worker's memory and
threads over minutes, are experiments/soak.py. Each case here runs in fresh child
processes of its own, `--rounds` rounds in rotated order, medians over the rounds
(experiments/benchlib.py). Memory, not time: these figures do not depend on what else
the machine runs.

`summary_writes`: resident memory per summary write, for each way of writing a window's
scalars. For each variant, after `--warmup` untimed writes, performs `--writes` writes
of the train window's scalars (7 tags, as `Controller.train` writes them at the default
settings) into a fresh logdir and reports the RSS slope in KiB per 1000 writes (least
squares over samples every 100 writes). Each variant runs in a fresh process of its own
(the first writes of a process grow its allocator's pools, whatever they write); RSS is
read from /proc/self/status (Linux).

- `eager`: TensorFlow's eager `tf.summary.scalar` per tag under `writer.as_default`,
  then `flush()` (the old way, which kept host memory per write);
- `eager_numpy_step`: the same with the step and values given as numpy scalars;
- `compiled`: `summaries.ScalarWriter.scalars` (one tf.function per set of tags writing
  every scalar of the window from one float vector);
- `lr_eager`: `float(schedule(step))` on the Keras learning-rate schedule, eagerly;
- `lr_numpy_step`: the same, the step given as a numpy int64;
- `lr_compiled`: `optim.compiled_schedule(schedule)(step)`, the schedule traced once.

`variables`: resident memory per 1000 makings of 14 variables of 64 x 64 floats, dropped
at once (the slots of a small optimizer): `keras_variables` (`keras.Variable`) against
`tf_variables` (`tf.Variable`), each in its own process, slopes as above. A sharded
update builds the whole optimizer state for every checkpoint it saves, so it makes plain
ones (mgloop/step/whole_state.py).

`sweep` (checks that a sweep holds one build in memory at a time: its peak no more than
1.5x its largest variant's): runs `python -m mgloop.sweep` once per method of `--methods` alone,
then once with every method, each in its own wrapper process whose RUSAGE_CHILDREN
ru_maxrss is the largest peak RSS of any process the sweep made (the sweep's own, and
each worker process: with the default --cells_per_process=4 a worker runs at most 4
cells). Writes the rows to <output_dir>/peaks.json unless --json_out says elsewhere.
"""

from __future__ import annotations

import os
import sys
import tempfile

from absl import app, flags
import numpy as np

from experiments import benchlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 1, "rounds over every case, each case a fresh process each")
flags.DEFINE_string("json_out", None, "write the rows (with command, settings, machine) here")
flags.DEFINE_integer("writes", 4000, "summary_writes: writes per variant after warm-up")
flags.DEFINE_integer("warmup", 2000, "summary_writes: untimed writes per variant")
flags.DEFINE_list("variants", ["eager", "eager_numpy_step", "compiled", "lr_eager",
                               "lr_numpy_step", "lr_compiled"],
                  "summary_writes: which variants, in order")
flags.DEFINE_bool("child", False, "internal (summary_writes): run the one variant here")
flags.DEFINE_list("methods", [
    "ring", "topk:ratio=0.01", "randomk:ratio=0.01,memory=residual", "qsgd", "terngrad",
    "signsgd", "efsignsgd", "onebit", "dgc:ratio=0.01,momentum=0", "powersgd:rank=1",
    "powersgd:rank=2", "powersgd:rank=4", "localsgd:period=8", "diloco:period=8"],
    "sweep: the variants (--aggregation), 14 by default")
flags.DEFINE_string("output_dir", "/tmp/sweep_memory", "sweep: where the sweeps write")
flags.DEFINE_integer("steps", 40, "sweep: steps per cell")
flags.DEFINE_integer("cells_per_process", 4, "sweep: the sweep's --cells_per_process")

# --- summary_writes -----------------------------------------------------------------------

TAGS = ("loss", "accuracy", "examples_per_sec", "step_time", "input_wait", "learning_rate",
        "memory/host/peak_rss_bytes")


def slope_per_1000(write: callable, writes: int, warmup: int) -> float:
    """KiB of RSS per 1000 calls of write(i), least squares over samples every 100 calls."""
    from mgloop.observe.diagnostics import current_rss_kib  # in the child, after its devices
    for i in range(warmup):
        write(i)
    xs, ys = [], []
    for i in range(writes):
        if i % 100 == 0:
            xs.append(i)
            ys.append(current_rss_kib())
        write(warmup + i)
    xs.append(writes)
    ys.append(current_rss_kib())
    return float(np.polyfit(xs, ys, 1)[0] * 1000)


def make_variant(name: str, logdir: str):
    import tensorflow as tf
    from mgloop.observe import summaries
    from mgloop.training import optim
    from mgloop.runs.config import Config
    values = {tag: 0.5 for tag in TAGS}
    if name == "eager":
        writer = tf.summary.create_file_writer(logdir)

        def write(step):
            with writer.as_default(step=step):
                for tag, value in values.items():
                    tf.summary.scalar(tag, value + step)
            writer.flush()
        return write
    if name == "eager_numpy_step":
        writer = tf.summary.create_file_writer(logdir)

        def write(step):
            with writer.as_default(step=np.int64(step)):
                for tag, value in values.items():
                    tf.summary.scalar(tag, np.float32(value + step))
            writer.flush()
        return write
    if name == "compiled":
        writer = summaries.ScalarWriter(logdir, "train")
        return lambda step: writer.scalars(step, {t: v + step for t, v in values.items()})
    config = Config(train_steps=10 ** 9, warmup_steps=100, lr_schedule="poly")
    schedule = optim.make_schedule(config.optim, config.train_steps)
    if name == "lr_eager":
        return lambda step: float(schedule(step))
    if name == "lr_numpy_step":
        return lambda step: float(schedule(np.int64(step)))
    if name == "lr_compiled":
        compiled = optim.compiled_schedule(schedule)
        return lambda step: compiled(step)
    raise app.UsageError(f"unknown variant {name}")


def slopes(command: str, variants, what: str, make_write) -> None:
    """Each of `variants` in fresh child processes (--rounds rounds): the RSS slope of
    `make_write(variant)` (a function of the call's index) per 1000 calls, published as a
    table of KiB per 1000 `what`. In a child (--child): the one variant of --variants."""
    if FLAGS.child:
        name, = FLAGS.variants
        benchlib.child_reply({"kib_per_1000_writes": slope_per_1000(
            make_write(name), FLAGS.writes, FLAGS.warmup)})
        return
    commands = {name: benchlib.child_command(
        __spec__.name, command, "--child", f"--variants={name}", f"--writes={FLAGS.writes}",
        f"--warmup={FLAGS.warmup}") for name in variants}
    rows = benchlib.summarize(benchlib.in_children(
        commands, FLAGS.rounds, log=lambda r, name, figures: print(
            f"round {r + 1}: {name:16s} {figures['kib_per_1000_writes']:12.1f} KiB per 1000 "
            f"{what}", flush=True)), "variant")
    benchlib.publish(
        f"{FLAGS.writes} {what} after {FLAGS.warmup}, each variant in its own process; "
        f"medians over {FLAGS.rounds} rounds", rows,
        [("variant", "variant", "s"), ("kib_per_1000_writes", f"KiB per 1000 {what}", ".1f")],
        FLAGS.json_out, {"writes": FLAGS.writes, "warmup": FLAGS.warmup,
                         "rounds": FLAGS.rounds})


def summary_writes(args) -> None:
    del args
    slopes("summary_writes", FLAGS.variants, "writes", lambda name: make_variant(
        name, tempfile.mkdtemp(prefix=f"summary-memory-{name}-")))


# --- variables ----------------------------------------------------------------------------

VARIABLE_KINDS = ("keras_variables", "tf_variables")


def making_variables(name: str):
    """step -> None: makes 14 variables of 64 x 64 floats of kind `name` and drops them."""
    import keras
    import tensorflow as tf
    make = keras.Variable if name == "keras_variables" else tf.Variable

    def write(step):
        del step
        made = [make(tf.zeros([64, 64])) for _ in range(14)]
        del made
    return write


def variables(args) -> None:
    del args
    slopes("variables", VARIABLE_KINDS, "makings of 14 variables", making_variables)


# --- sweep --------------------------------------------------------------------------------

_PEAK = ("import json, resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
         f"print({benchlib.RESULT!r} + json.dumps({{'peak_mb': "
         "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0}), flush=True); "
         "sys.exit(code)")


def sweep_command(methods: list[str], folder: str) -> list[str]:
    """A wrapper process running one sweep over `methods`; it replies with the largest peak
    RSS (MB) of any process of the sweep."""
    return [sys.executable, "-c", _PEAK, sys.executable, "-m", "mgloop.sweep",
            f"--output_dir={folder}", "--seeds=1", "--vary=aggregation=" + ";".join(methods),
            "--set=dataset=digits", "--set=model=mlp", "--set=devices=cpu:4", "--set=nodes=4",
            "--set=global_batch_size=128", f"--set=train_steps={FLAGS.steps}",
            "--set=checkpoint_every=0", "--evals=2",
            f"--cells_per_process={FLAGS.cells_per_process}"]


def sweep(args) -> None:
    del args
    together = f"all {len(FLAGS.methods)} in one sweep"
    commands = {f"`{method}` alone": sweep_command([method], os.path.join(
        FLAGS.output_dir, f"alone-{index}")) for index, method in enumerate(FLAGS.methods)}
    commands[together] = sweep_command(FLAGS.methods, os.path.join(FLAGS.output_dir,
                                                                   "together"))
    rows = benchlib.summarize(benchlib.in_children(commands, FLAGS.rounds), "sweep")
    largest = max(row["peak_mb"] for row in rows if row["sweep"] != together)
    for row in rows:
        row["ratio_to_largest_alone"] = row["peak_mb"] / largest
    benchlib.publish(
        f"peak RSS of any process of each sweep; medians over {FLAGS.rounds} rounds", rows,
        [("sweep", "sweep", "s"), ("peak_mb", "peak RSS (MB)", ".0f"),
         ("ratio_to_largest_alone", "ratio to the largest variant alone", ".2f")],
        FLAGS.json_out or os.path.join(FLAGS.output_dir, "peaks.json"),
        {"methods": FLAGS.methods, "steps": FLAGS.steps, "rounds": FLAGS.rounds,
         "cells_per_process": FLAGS.cells_per_process})


COMMANDS = {"summary_writes": (summary_writes, {}), "variables": (variables, {}),
            "sweep": (sweep, {})}


if __name__ == "__main__":
    app.run(lambda argv: benchlib.dispatch(argv, COMMANDS))
