"""Summary writes keep no host memory (issue 13, item 2).

Before the fix every window of 7 scalars kept about 1.5 KiB (eager `tf.summary.scalar`
on a Python-int step) and every learning-rate read about 0.66 KiB (the Keras schedule
called eagerly on a Python int): TensorFlow caches the tensor of every distinct Python
scalar it converts (TFE_TensorHandleCache) and never frees it
(experiments/memory.py summary_writes, docs/results/long-runs.md).
"""

from __future__ import annotations

from mgloop.observe import summaries
from mgloop.training import optim
from mgloop.observe.diagnostics import current_rss_kib
from mgloop.runs.config import Config

WRITES = 3000
# The old writes grew RSS by ~2.2 KiB per write, ~6.3 MiB over WRITES; the fixed ones by
# ~1.3 KiB per 1000 writes (memory.py summary_writes). 1.5 MiB sits 4x below the old
# growth and ~400x above the new, leaving room for allocator noise.
MAX_GROWTH_KIB = 1536


def test_summary_windows_and_learning_rate_keep_no_memory(tmp_path):
    writer = summaries.ScalarWriter(str(tmp_path), "train")
    config = Config(train_steps=10 ** 9, warmup_steps=100, lr_schedule="poly")
    learning_rate = optim.compiled_schedule(optim.make_schedule(config.optim,
                                                                config.train_steps))

    def window(step):  # what Controller.train writes every --summary_every steps
        writer.scalars(step, {"loss": 0.5, "accuracy": 0.25, "examples_per_sec": 1e4 + step,
                              "step_time": 1e-3, "input_wait": 1e-5,
                              "learning_rate": learning_rate(step),
                              "memory/host/peak_rss_bytes": 6e8})

    for step in range(500):  # warm-up: tracing, the allocator's first pools
        window(20 * step)
    before = current_rss_kib()
    for step in range(500, 500 + WRITES):
        window(20 * step)  # distinct steps, as in a run
    grown = current_rss_kib() - before
    writer.close()
    assert grown < MAX_GROWTH_KIB, (
        f"RSS grew by {grown} KiB over {WRITES} summary windows (bound {MAX_GROWTH_KIB})")
