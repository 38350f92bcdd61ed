"""Resident memory per summary write: each way of writing a window's scalars, in-process.

    python experiments/bench_summary_memory.py --writes=4000 [--variants=eager,compiled,...]

For each variant, after `--warmup` untimed writes, performs `--writes` writes of the
train window's scalars (7 tags, as `controller.fit` writes them at the default settings)
into a fresh logdir and reports the RSS slope in KiB per 1000 writes (least squares over
samples every 100 writes). Each variant runs in a fresh process of its own (the first
writes of a process grow its allocator's pools, whatever they write); RSS is read from
/proc/self/status (Linux).

- `eager`: TensorFlow's eager `tf.summary.scalar` per tag under `writer.as_default`,
  then `flush()` (what `ScalarWriter.scalars` did before issue 13);
- `eager_numpy_step`: the same with the step and values given as numpy scalars;
- `compiled`: `summaries.ScalarWriter.scalars` (one tf.function per set of tags writing
  every scalar of the window from one float vector);
- `lr_eager`: `float(schedule(step))` on the Keras learning-rate schedule, eagerly;
- `lr_numpy_step`: the same, the step given as a numpy int64;
- `lr_compiled`: `optim.compiled_schedule(schedule)(step)`, the schedule traced once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import numpy as np  # noqa: E402

_FLAGS = flags.FLAGS
flags.DEFINE_integer("writes", 4000, "writes per variant after warm-up")
flags.DEFINE_integer("warmup", 2000, "untimed writes per variant")
flags.DEFINE_list("variants", ["eager", "eager_numpy_step", "compiled", "lr_eager",
                               "lr_numpy_step", "lr_compiled"],
                  "which variants, in order")
flags.DEFINE_string("json_out", None, "also write the results here as JSON")
flags.DEFINE_bool("child", False, "internal: run the one variant in this process")

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
    from mgloop.spec import optim
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
    schedule = optim.make_schedule(Config(train_steps=10 ** 9, warmup_steps=100,
                                          lr_schedule="poly"))
    if name == "lr_eager":
        return lambda step: float(schedule(step))
    if name == "lr_numpy_step":
        return lambda step: float(schedule(np.int64(step)))
    if name == "lr_compiled":
        compiled = optim.compiled_schedule(schedule)
        return lambda step: compiled(step)
    raise app.UsageError(f"unknown variant {name}")


def main(argv):
    del argv
    if _FLAGS.child:
        name, = _FLAGS.variants
        logdir = tempfile.mkdtemp(prefix=f"summary-memory-{name}-")
        print(json.dumps(slope_per_1000(make_variant(name, logdir), _FLAGS.writes,
                                        _FLAGS.warmup)))
        return
    results = {}
    for name in _FLAGS.variants:
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", f"--variants={name}",
             f"--writes={_FLAGS.writes}", f"--warmup={_FLAGS.warmup}"],
            check=True, capture_output=True, text=True).stdout
        results[name] = float(out.strip().splitlines()[-1])
        print(f"{name:12s} {results[name]:8.1f} KiB per 1000 writes", flush=True)
    if _FLAGS.json_out:
        with open(_FLAGS.json_out, "w") as handle:
            json.dump({"writes": _FLAGS.writes, "warmup": _FLAGS.warmup,
                       "kib_per_1000_writes": results}, handle, indent=2)


if __name__ == "__main__":
    app.run(main)
