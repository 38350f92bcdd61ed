"""A long run keeps no Python objects per loop and traces nothing after warm-up (issue 23).

Before the fix, `mgloop.run` kept one History record (a dict of the loop's metrics,
~1.5 KiB) per summary window, or per loop without summaries, one float per loop for
the median step time, and one compiled glob pattern per checkpoint in `fnmatch`'s
cache (TensorFlow globs `ckpt-<step>*` after each save): 6.7 MB/min in a soak of the
default run (experiments/soak.py, docs/results/long-runs.md). Here one short run with every hook on
(diagnostics, summaries, histograms, evaluation, checkpoints, accumulation, mixed
precision, a stateful method) and tiny loops passes warm-up (every bounded collection
full, every function traced), then is measured over MEASURED_LOOPS loops:

- traces: every tf.function's trace count is the same at the end as after warm-up
  (those made since the test began: the run's; the objects earlier tests in the process
  left are frozen out of the collector's walks, `gc.freeze`, and so is any function
  made at an import);
- live objects the garbage collector tracks, by type (dicts holding containers,
  compiled patterns, weakrefs): fewer than one new object in four loops, but for the log
  records pytest's log capture holds (it keeps every record a test emits, twice: caplog's
  and the report's; a run outside pytest keeps none). The run logs at INFO, as after
  any earlier test in the process that parsed absl's flags: whether its lines were
  records used to depend on which tests ran before it in its process;
- what mgloop's own code allocated and still holds (tracemalloc, by the line that
  allocated: floats and dicts of floats too, which the collector does not track): less
  than 1/8 of the old code's least growth, a History record of >= 400 B a loop.
  TensorFlow's own caches are left out of this one: they settle by ~50 blocks of
  Python memory now and then after warm-up, which would hide nothing of mgloop's but
  would make the bound depend on TensorFlow's version.
The RSS of the whole process, native memory included, is the soak's (docs/results/long-runs.md).
"""

from __future__ import annotations

import collections
import fnmatch
import gc
import logging
import os
import re
import tracemalloc

import pytest
import tensorflow as tf
from absl import logging as absl_logging

import mgloop
from mgloop.runs import callbacks, controller
from mgloop.runs.thinned import Thinned
from tests import helpers

WARMUP_STEPS, MEASURED_STEPS, STEPS_PER_LOOP = 60, 160, 2
END = WARMUP_STEPS + MEASURED_STEPS
# tracemalloc sees only what is allocated once it runs: it starts TRACED_BEFORE steps
# before the measured loops, so the objects a loop replaces (its windows, the last
# History records) are traced at both ends
TRACED_BEFORE = 40
MEASURED_LOOPS = MEASURED_STEPS // STEPS_PER_LOOP
# The old code kept at least one dict a loop (a History record); what may appear over
# the measured loops is a few objects that TensorFlow or Python keep in caches that
# are full long before (e.g. one weakref per thread a checkpoint write started).
MAX_NEW_OBJECTS = MEASURED_LOOPS // 4
# The old History's least growth: a record is a dict of >= 6 entries (step, loss,
# accuracy, examples_per_sec, step_time, input_wait), >= 400 B with its floats.
OLD_BYTES_PER_LOOP = 400
MAX_NEW_BYTES = OLD_BYTES_PER_LOOP * MEASURED_LOOPS // 8
MGLOOP_FILES = os.path.join(os.path.dirname(os.path.abspath(mgloop.__file__)), "*")

EVERY_HOOK = dict(diagnostics=True, summary_every=STEPS_PER_LOOP, log_every=10,
                  checkpoint_every=10, histogram_every=10, eval_every=20,
                  accumulation_steps=2, mixed_precision="mixed_float16",
                  aggregation="topk:ratio=0.25", learning_rate=0.02)


def traces() -> int:
    """Traces made so far by every tf.function alive in the process."""
    return sum(f.experimental_get_tracing_count() for f in gc.get_objects()
               if isinstance(f, tf.types.experimental.PolymorphicFunction))


def live_objects() -> collections.Counter:
    """Objects the garbage collector tracks, by type name, after a full collection;
    `re`'s own cache (512 patterns at most, whatever the run's length) emptied first."""
    re.purge()
    gc.collect()
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


def captured_records() -> int:
    """Log records held by the root logger's handlers that keep them (pytest's log capture:
    its caplog and report handlers each keep every record of the test)."""
    return sum(len(handler.records) for handler in logging.getLogger().handlers
               if isinstance(getattr(handler, "records", None), list))


def held_by_mgloop() -> int:
    """Bytes still held that a line of mgloop's own code allocated (since tracing began)."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, MGLOOP_FILES)])
    return sum(stat.size for stat in snapshot.statistics("filename"))


def test_a_long_run_keeps_nothing_per_loop(tmp_path, monkeypatch):
    monkeypatch.setattr(callbacks, "HISTORY_LIMIT", 2)  # both reached during warm-up, and
    monkeypatch.setattr(controller, "LOOP_TIMES_LIMIT", 2)  # they hold 1 or 2 items after
    seen = {}

    def measure(step, metrics):
        if step == WARMUP_STEPS - TRACED_BEFORE:
            live_objects()  # its first call leaves ~55 weakrefs (with their callbacks) behind
            tracemalloc.start(1)  # by the line that allocated
        if step == WARMUP_STEPS:
            seen["traces"], seen["objects"] = traces(), live_objects()
            seen["bytes"], seen["records"] = held_by_mgloop(), captured_records()
        if step == END:
            seen["bytes after"] = held_by_mgloop()
            tracemalloc.stop()
            seen["traces after"], seen["objects after"] = traces(), live_objects()
            seen["records after"] = captured_records()
            seen["glob patterns"] = fnmatch._compile_pattern.cache_info().currsize
        return False

    config = helpers.small_config(str(tmp_path / "run"), devices="cpu:2", deterministic=False,
                                  train_steps=END + 10, steps_per_loop=STEPS_PER_LOOP,
                                  **EVERY_HOOK)
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.INFO)
    # what earlier tests in this process left (a million objects and more) is frozen, so
    # the counts and collections below walk what this run made, not all of it
    gc.collect()
    gc.freeze()
    try:
        result = mgloop.run(config, callbacks=[measure])
    finally:
        tracemalloc.stop()
        gc.unfreeze()
        absl_logging.set_verbosity(verbosity)
    assert result["final_step"] == END + 10
    assert seen["traces after"] == seen["traces"], "a function was traced again after warm-up"
    assert seen["records after"] > seen["records"]  # the run logged, and pytest kept it
    # the types whose count went up, by how much, but for the records pytest's capture holds
    grown = (seen["objects after"] - seen["objects"]
             - collections.Counter(LogRecord=seen["records after"] - seen["records"]))
    assert sum(grown.values()) <= MAX_NEW_OBJECTS, (
        f"{sum(grown.values())} more live objects after {MEASURED_LOOPS} loops "
        f"(bound {MAX_NEW_OBJECTS}): {grown.most_common(5)}")
    new_bytes = seen["bytes after"] - seen["bytes"]
    assert new_bytes <= MAX_NEW_BYTES, (
        f"mgloop's code holds {new_bytes} B more after {MEASURED_LOOPS} loops (bound "
        f"{MAX_NEW_BYTES} B; the old History alone: >= {OLD_BYTES_PER_LOOP} B a loop)")
    assert seen["glob patterns"] <= 1  # a checkpoint's pattern is forgotten after its save
    assert len(result.history.records) <= 2 and result.history.stride > 1


@pytest.mark.parametrize("limit", [2, 3, 8])
def test_thinned_keeps_every_stride_th_item_and_at_most_limit(limit):
    kept = Thinned(limit)
    for n in range(1, 200):
        kept.append(n - 1)
        assert len(kept) <= limit
        assert kept.items == list(range(0, n, kept.stride))  # evenly over all appended
        assert len(kept) >= limit // 2 or kept.stride == 1


def test_history_keeps_evals_and_summary_records_thinned():
    history = callbacks.History(every=2, limit=4)
    for step in range(1, 21):
        history(step, {"train/loss": float(step)} if step != 5 else {"eval/loss": 1.0})
    # records made at steps 2, 4, 5 (eval), 6, 8, ..., 20: 11 records, one in 4 kept
    assert history.stride == 4
    assert [r["step"] for r in history.records] == [2, 8, 16]
    assert history.of("train/loss") == ([2, 8, 16], [2.0, 8.0, 16.0])
