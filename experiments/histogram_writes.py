"""TensorBoard histograms: eager per tag against `ScalarWriter.histograms`, side by side.

    python -m experiments.histogram_writes --rounds=7 --writes=20

What `--histogram_every` costs a run at each write: the weights and last gradients of the
mlp (12 tags: 192x128, 128, 128x128, 128, 128x10, 10, twice), written `--writes` times per
round into a fresh logdir per case. `eager`: `tf.summary.histogram` per tag under
`writer.as_default`, then `flush()` (how mgloop wrote them before); `compiled`:
`summaries.ScalarWriter.histograms` (eager the first time, one compiled call after; its
first write is made before the rounds, as a run's first histogram write is). Reported: the
median CPU milliseconds per write of each case over the rounds, and the ratio to `eager`.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np
from absl import app, flags

from experiments import benchlib

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 7, "rounds side by side; each case once per round")
flags.DEFINE_integer("writes", 20, "histogram writes per case and round")
SHAPES = [(192, 128), (128,), (128, 128), (128,), (128, 10), (10,)]


def main(argv):
    del argv
    import tensorflow as tf
    from mgloop.observe import summaries

    rng = np.random.default_rng(0)
    values = {f"{kind}/{i}": rng.standard_normal(shape).astype(np.float32)
              for kind in ("weights", "gradients") for i, shape in enumerate(SHAPES)}
    eager_writer = tf.summary.create_file_writer(tempfile.mkdtemp())
    compiled_writer = summaries.ScalarWriter(tempfile.mkdtemp(), "train")

    def eager(step):
        with eager_writer.as_default(step=np.int64(step)):
            for tag, value in values.items():
                tf.summary.histogram(tag, value)
        eager_writer.flush()

    def cpu_ms_per_write(write):
        def run():
            began = time.process_time()
            for step in range(FLAGS.writes):
                write(step)
            return 1e3 * (time.process_time() - began) / FLAGS.writes
        return run

    eager(0)
    compiled_writer.histograms(0, values)  # the eager first write; the rounds' are compiled
    samples = benchlib.rounds({"eager": cpu_ms_per_write(eager), "compiled": cpu_ms_per_write(
        lambda step: compiled_writer.histograms(step, values))}, FLAGS.rounds)
    rows = benchlib.summarize(samples)
    benchlib.add_ratio(rows, "median", "eager")
    benchlib.publish(f"CPU ms per write of {len(values)} histograms, medians over "
                     f"{FLAGS.rounds} rounds side by side", rows,
                     [("case", "case", "s"), ("median", "median ms", ".2f"),
                      ("mad", "± MAD ms", ".2f"), ("ratio", "÷ eager", ".2f")])


if __name__ == "__main__":
    app.run(main)
