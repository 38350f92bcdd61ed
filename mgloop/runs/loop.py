"""The compiled loop: many training steps (step/training_step.py) in one `tf.function` call.

The staging (staging.py) hands each step its global batch split into T
contiguous shards of B/T examples, tower 0 first, already on the towers.
`train_loop` runs up to `num_steps` such steps inside one `tf.function` call (a
`while` loop in the graph), so Python runs once per loop, not once per step; the outer
loop (`Controller.train`) chooses loop lengths so that summaries, logs and
checkpoints fall on their step boundaries.

Input wait, per step, is measured inside the compiled loop with `staging.clock()`
(`tf.timestamp`), as the time step t spends on its input beyond its compute:

    wait_t = (ready_t - begin_t) + (end_t - compute_end_t)

begin_t: step t starts (after step t-1 has ended); ready_t: step t's shards
are on every tower; compute_end_t: every variable copy holds step t's update;
end_t: that, and (under `device` staging) the batch of step t+K is staged.
The first term is the time the towers sit idle at the start of step t
because its input is not there (under `none` it is the whole host pipeline
and copy); the second, the time step t is held up after its compute by
staging a later batch. The sum is zero when input is fully hidden behind
compute. Priming the staging areas before a loop counts as wait of that loop.

The step is traced without AutoGraph, as Keras's own `fit` traces its train step
(keras/src/backend/tensorflow/trainer.py): the step's Python loops and conditions are
on Python values (towers, variables, options), and AutoGraph's rewriting of every
function the step calls cost about half of its tracing time (experiments/startup.py).
A model, loss or metric that branches on a tensor's value uses `keras.ops.cond` /
`tf.cond`, or is itself a `tf.function` (as under `fit`). The loop around the steps is
written as `tf.while_loop` and `tf.cond` itself, so AutoGraph converts nothing of the loop
or the step (its conversion of the loop and the staging cost 0.4-1 s in every new process:
docs/results/long-runs.md); tf.data still converts the input pipeline's functions. Its
condition asks the staging whether a batch may be left (`may_have_batch`): device staging
knows it from its count (`knows_ahead`), so its loop has no flag for the end of the input
and its step is not inside a conditional; host staging learns it only by taking the next
batch, so its steps are (a `tf.cond` on whether there was one, whose false branch ends the
loop).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import traceback
from typing import Iterator

import numpy as np
import tensorflow as tf

from mgloop.data import staging as staging_lib
from mgloop.errors import TensorBranchError
from mgloop.phases import INPUT, STEP_SCOPE  # name scopes by which a profile is read
from mgloop.runs.tracing_log import logged_trace
from mgloop.training import metrics as metrics_lib


@contextlib.contextmanager
def tensor_branches_refused():
    """Around the first call of a function traced without AutoGraph: a tensor used as a
    Python bool (TensorFlow's OperatorNotAllowedInGraphError, a traceback through the
    step) becomes one line naming the user's line and the fix."""
    try:
        yield
    except tf.errors.OperatorNotAllowedInGraphError as error:
        frames = [(f.filename, f.lineno, f.line or "") for f in traceback.extract_tb(
            error.__traceback__) if f"{os.sep}tensorflow{os.sep}" not in f.filename]
        where = (f" at {frames[-1][0]}:{frames[-1][1]} ({frames[-1][2].strip()})"
                 if frames else "")
        raise TensorBranchError(
            f"the model, loss or a metric uses a tensor as a Python bool{where}; mgloop traces "
            "the step without AutoGraph, as Keras's fit does: use keras.ops.cond or tf.cond, "
            "or make that function a tf.function") from None


@dataclasses.dataclass
class LoopResult:
    """What one call of `Loop.train_loop` did."""

    steps: int  # steps run: fewer than asked when the input ended
    loss_sum: float  # sum over those steps of the mean loss over the global batch
    # metric name -> its state summed over those steps' towers (metrics.py), float64
    metric_sums: dict[str, np.ndarray]
    input_wait: float  # seconds the towers waited for input, over those steps
    # --diagnostics: the `stat_names` values of the loop's last step, if it was sampled
    stats: dict[str, float] = dataclasses.field(default_factory=dict)


class Loop:
    """Runs `step` (and, with --diagnostics, `sampled_step` with names `stat_names` for its
    "stats" report) on the batches the `staging` hands the towers, in compiled loops."""

    def __init__(self, step, staging: staging_lib.HostStaging, metrics,
                 sampled_step=None, stat_names=()):
        self.step, self.sampled_step, self.staging = step, sampled_step, staging
        self.metrics, self.stat_names = list(metrics), list(stat_names)
        self._input = None  # the iterator whose batches the staging holds

    def train_loop(self, iterator: Iterator, num_steps: int,
                   sample_stats: bool = True) -> LoopResult:
        """Up to `num_steps` steps on the iterator's global batches, in compiled calls.

        Fewer steps run only if the iterator ends (then every batch it gave has
        been trained on). Batches staged ahead stay staged for the next call
        with the same iterator; given another iterator, the staging first drops
        what the previous one staged. With --diagnostics and `sample_stats`, the
        gradient statistics are computed on the loop's last step alone (a
        sample, as summaries are): the loop runs `num_steps - 1` steps of the
        step without them, then that last step in a compiled call of its own,
        `sampled_once` (traced at the first sample, not with the loop: the first
        step traces the step once), and returns them in `stats`.
        """
        if iterator is not self._input:
            self.staging.clear()
            self._input = iterator
        began = time.perf_counter()
        self.staging.prime(iterator)
        primed = time.perf_counter() - began
        sampled = sample_stats and self.sampled_step is not None
        out = self._call(self.compiled_loop, self._traced_what(), iterator,
                         tf.constant(num_steps - int(sampled), tf.int32))
        out = {key: value.numpy() for key, value in out.items()}
        stats = {}
        if sampled and int(out["steps"]) == num_steps - 1:
            last = self._call(self.sampled_once, "the sampled step (--diagnostics) of "
                              + self._traced_what(), iterator)
            last = {key: value.numpy() for key, value in last.items()}
            if last["sampled"]:
                out = {key: out[key] + last[key] for key in out}
                stats = dict(zip(self.stat_names, last["stats"].tolist()))
        return LoopResult(steps=int(out["steps"]), loss_sum=float(out["loss_sum"]),
                          metric_sums=metrics_lib.split(self.metrics, out["metric_sums"]),
                          input_wait=float(out["input_wait"]) + primed, stats=stats)

    @staticmethod
    def _call(function, what: str, *args) -> dict:
        """`function(*args)`; its first call traces (minutes for some methods): logged."""
        tracing = (logged_trace(what) if function.experimental_get_tracing_count() == 0
                   else contextlib.nullcontext())
        with tracing, tensor_branches_refused():
            return function(*args)

    def _traced_what(self) -> str:
        """What the trace builds, for its log line."""
        replicas = self.step.replicas
        return (f"{replicas.num_towers} towers, {len(replicas.model.trainable_variables)} "
                f"variables, aggregation {replicas.aggregation.name}")

    def release_input(self) -> None:
        """Drops whatever the current iterator has staged (the end of a `Controller.train`)."""
        self.staging.clear()
        self._input = None

    @tf.function(autograph=False)  # its loop and conditionals are written out (top)
    def compiled_loop(self, iterator: Iterator, num_steps: tf.Tensor) -> dict[str, tf.Tensor]:
        """The loop of `train_loop`: sums over the steps run, and their count."""
        sums = (tf.constant(0.0),  # exact sums: loss, metric states, input wait, steps
                tf.zeros([metrics_lib.total_size(self.metrics)], tf.float64),
                tf.constant(0.0, tf.float64), tf.constant(0))
        # the condition reads the staging's count after the last step's end (not a loop variable)
        if self.staging.knows_ahead:  # device staging: no `break`, so no conditional either
            def condition(loss_sum, metric_sums, wait, steps, end):
                return tf.logical_and(steps < num_steps, self.staging.may_have_batch(after=end))

            def body(loss_sum, metric_sums, wait, steps, end):
                begin, _, take = self._next_batch(iterator, after=end)
                return self._counted_step(take, begin, loss_sum, metric_sums, wait, steps)
            out = tf.while_loop(condition, body, (*sums, staging_lib.clock()))
        else:  # host staging learns whether a batch is left by taking it: the step in a cond
            def condition(loss_sum, metric_sums, wait, steps, end, more):
                return tf.logical_and(more, tf.logical_and(
                    steps < num_steps, self.staging.may_have_batch(after=end)))

            def body(loss_sum, metric_sums, wait, steps, end, more):
                begin, has_batch, take = self._next_batch(iterator, after=end)
                return tf.cond(
                    has_batch,
                    lambda: (*self._counted_step(take, begin, loss_sum, metric_sums, wait,
                                                 steps), tf.constant(True)),
                    lambda: (loss_sum, metric_sums, wait, steps, end, tf.constant(False)))
            out = tf.while_loop(condition, body, (*sums, staging_lib.clock(), tf.constant(True)))
        loss_sum, metric_sums, wait, steps = out[:4]
        return {"steps": steps, "loss_sum": loss_sum, "metric_sums": metric_sums,
                "input_wait": wait}

    @tf.function(autograph=False)  # its conditionals are written out (top)
    def sampled_once(self, iterator: Iterator) -> dict[str, tf.Tensor]:
        """The sampled step (--diagnostics: the step with its statistics' hook) on the next
        batch, if one is left: the sums of `compiled_loop` over it (0 or 1 step), its
        statistics and whether it ran. A function of its own, so that the loop's steps are
        exactly the step without the statistics (no per-step cost) and the first call of
        the loop traces the step once. Its trace leaves the traffic counts as the ordinary
        step's."""
        none = (tf.constant(0), tf.constant(0.0), tf.zeros([metrics_lib.total_size(
            self.metrics)], tf.float64), tf.constant(0.0, tf.float64),
            tf.zeros([len(self.stat_names)]), tf.constant(False))
        end = staging_lib.clock()

        def sampled_step():
            begin, has_batch, take = self._next_batch(iterator, after=end)

            def run():
                traffic = self.sampled_step.replicas.aggregation.traffic
                ordinary = traffic.snapshot()
                result, wait, _ = self._timed_step(self.sampled_step, take, begin)
                traffic.restore(ordinary)  # the counts stay the ordinary step's
                return (tf.constant(1), result.loss, tf.cast(result.metric_state, tf.float64),
                        wait, result.report["stats"], tf.constant(True))
            if self.staging.knows_ahead:  # device staging: has_batch is True
                return run()
            return tf.cond(has_batch, run, lambda: none)
        out = tf.cond(self.staging.may_have_batch(after=end), sampled_step, lambda: none)
        return dict(zip(("steps", "loss_sum", "metric_sums", "input_wait", "stats", "sampled"),
                        out))

    def _counted_step(self, take, begin, loss_sum, metric_sums, wait, steps):
        """The loop's step on the batch `take()` gives, added to the loop's sums: (loss_sum,
        metric_sums, wait, steps, the step's end time)."""
        result, step_wait, end = self._timed_step(self.step, take, begin)
        return (loss_sum + result.loss, metric_sums + tf.cast(result.metric_state, tf.float64),
                wait + step_wait, steps + 1, end)

    def _next_batch(self, iterator, after: tf.Tensor):
        """(the step's begin time, read once `after` has run; has a batch?; take)."""
        with tf.control_dependencies([after]):
            begin = staging_lib.clock()
        with tf.name_scope(INPUT):
            has_batch, take = self.staging.next_batch(iterator, after=begin)
        return begin, has_batch, take

    def _timed_step(self, step, take, begin: tf.Tensor):
        """`step` on the batch `take()` gives, begun at `begin`: (its StepResult, its input
        wait (see the top of this module), its end time)."""
        with tf.name_scope(STEP_SCOPE):
            with tf.name_scope(INPUT):
                shards, staged = take()
            with tf.control_dependencies(tf.nest.flatten(shards)):
                ready = staging_lib.clock()
            result = tf.autograph.experimental.do_not_convert(step)(shards)
            with tf.control_dependencies([result.done]):
                compute_end = staging_lib.clock()
            with tf.control_dependencies([compute_end] + staged):
                step_end = staging_lib.clock()
            # tf.timestamp reads the wall clock, which the system may set back by a few
            # microseconds between two reads: a term is never less than 0.
            wait = tf.maximum(ready - begin, 0.0) + tf.maximum(step_end - compute_end, 0.0)
            return result, wait, step_end
