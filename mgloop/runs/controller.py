"""The outer loop: runs a Trainer's compiled loops from its step to `train_steps`.

Python runs here once per compiled loop (`Trainer.train_loop`), never per step.
`Controller.train` is a loop over windows of steps, as Orbit's controller: each window
is one compiled loop, whose length makes summaries, log lines, checkpoints and the
monitor's events fall exactly on their step boundaries; after it come the actions due
at its last step (a summary, a log line, a checkpoint, the monitor's evals, histograms
and profiles, the callbacks, the stop check), each a named helper. The loops' results
are summed into windows (since the last summary, since the last log line: windows.py).
Speeds are taken without tracing: the first loop runs its first step alone (the call
that traces and first runs the compiled loop) and then its other steps, and every speed
(examples/sec, step time, the median step a link model's compute comes from) is taken
over the steps after that first one. A run of one step has nothing but the traced step:
it reports no speed (None) and says so in one log line. What the loop runs is a
`LoopPlan` (steps and intervals); what it works with (trainer, batches, summaries,
checkpoints, monitor, stop check, callbacks) is injected as `LoopParts`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from absl import logging
import numpy as np
import tensorflow as tf

from mgloop.runs import failures
from mgloop.runs.thinned import Thinned
from mgloop.runs.trainer import Trainer
from mgloop.runs.windows import Progress, TimedLoop, Window, run_loop
from mgloop.training import metrics as metrics_lib


LOOP_TIMES_LIMIT = 4096  # loop times the median step time is taken over, at most


@dataclasses.dataclass(frozen=True)
class LoopPlan:
    """The step a `train` runs to and where its actions fall (every N steps; 0: never)."""

    train_steps: int  # the last step (earlier if the input ends or a stop is asked)
    global_batch: int  # examples per step, for the speeds
    steps_per_loop: int  # the most steps in one compiled loop
    summary_every: int = 0
    log_every: int = 0  # (a log line also at train_steps and where the input ended)
    checkpoint_every: int = 0  # (a checkpoint is also written at the end)


@dataclasses.dataclass(frozen=True)
class LoopParts:
    """What a `train` works with, injected (None: that action is not taken).

    `batches` yields the global batches from the trainer's current step on; at most
    `train_steps - start` of them are read (so staging drains at the end instead of holding
    batches no step will use). `monitor` adds loop boundaries (`stops(step)`), runs
    `before_loop(step)` / `after_loop(step)` around each loop and adds scalars to each
    summary (`scalars(step)`). `should_stop()` is asked after every loop that does not end
    the train (the same number of times on every worker). `callbacks` are called after
    every loop with (step, that loop's "train/..." and, if it evaluated, "eval/..."
    metrics); one returning True ends the train there.
    """

    trainer: Trainer
    batches: tf.data.Dataset
    summaries: object = None  # `scalars(step, dict)` (observe/summaries.py)
    checkpointer: object = None  # `save(step)`, `latest` (checkpoint.py)
    learning_rate: Callable[[int], float] | None = None  # of a step, in each summary
    monitor: object = None  # monitor.Monitor
    should_stop: Callable[[], bool] | None = None  # e.g. a signal (preemption.py)
    callbacks: Sequence[Callable[[int, dict], bool]] = ()  # callbacks.py


@dataclasses.dataclass
class FitResult:
    start_step: int
    final_step: int  # train_steps, or earlier if the input ended
    train: dict[str, float]  # metrics of the last window
    # seconds per step of each loop's timed steps (not the run's first, traced, step;
    # an even sample past 4096 loops); None: only the traced step ran
    median_step_time: float | None
    examples_per_sec: float | None  # over the timed steps
    input_wait: float | None  # seconds per step, over the timed steps
    input_wait_fraction: float | None  # input_wait / mean step time, same loops
    loop_seconds: float  # all loops, tracing included
    traced_step_seconds: float | None = None  # the run's first step: trace and first run
    input_ended: bool = False  # the input ran out before train_steps
    stopped: bool = False  # should_stop() ended the fit early (a signal: preemption.py)
    stopped_by: object = None  # the callback that ended the fit early (callbacks.py)


class Controller:
    """Runs `parts.trainer` to `plan.train_steps`, one window of steps per compiled loop."""

    def __init__(self, plan: LoopPlan, parts: LoopParts):
        self.plan, self.parts = plan, parts

    def train(self) -> FitResult:
        """Trains from the trainer's step to `plan.train_steps` (earlier: the input ended, a
        stop was asked, a callback said stop); a checkpoint is always written at the end.
        Whatever is still staged when it ends (or fails) is dropped: a later train starts
        from a fresh iterator at its own step."""
        run = self._begin()
        try:
            while run.step < self.plan.train_steps:
                loop = self._run_window(run)
                if not loop.result.steps:
                    break
                run.add(loop)
                self._refuse_non_finite(run, loop.result.loss_sum, loop.result.steps)
                self._maybe_write_summary(run)
                self._maybe_log(run)
                self._maybe_save_checkpoint(run.step)
                self._monitor_after_loop(run.step)
                if self._should_end(run):
                    break
        finally:
            self.parts.trainer.release_input()
        self._save_final_checkpoint(run)
        return self._result(run)

    def _begin(self) -> Progress:
        trainer = self.parts.trainer
        start = int(trainer.global_step.numpy())
        batches = self.parts.batches.take(max(self.plan.train_steps - start, 0))
        windows = [Window(trainer.metrics) for _ in range(4)]
        return Progress(start, start, iter(trainer.staging.pipeline(batches)), trainer.metrics,
                        *windows, Thinned(LOOP_TIMES_LIMIT))

    def _window_length(self, step: int) -> int:
        """Steps to the nearest boundary: train_steps, steps_per_loop, the next summary, log
        line or checkpoint, and the monitor's."""
        plan, monitor = self.plan, self.parts.monitor
        stops = [plan.train_steps, step + plan.steps_per_loop] + [
            b for b in (_next_boundary(step, plan.summary_every),
                        _next_boundary(step, plan.log_every),
                        _next_boundary(step, plan.checkpoint_every)) if b is not None]
        if monitor is not None:
            stops += [b for b in monitor.stops(step) if b > step]
        return min(stops) - step

    def _run_window(self, run: Progress) -> TimedLoop:
        """One compiled loop up to the next boundary; notes (one line) an input that ended."""
        step, every = run.step, self.plan.summary_every
        num = self._window_length(step)
        if self.parts.monitor is not None:
            self.parts.monitor.before_loop(step)
        # --diagnostics: gradient statistics of the last step of each summary window only
        sample = bool(every) and (step + num) % every == 0
        loop = run_loop(self.parts.trainer, run.iterator, num, sample, run.first_loop)
        run.count_time(loop)
        if loop.result.steps < num:
            run.input_ended = True
            logging.warning("the input ended after step %d of %d", step + loop.result.steps,
                            self.plan.train_steps)
        return loop

    def _refuse_non_finite(self, run: Progress, loss_sum: float, steps: int) -> None:
        """Before any summary or checkpoint of the loop's steps."""
        if np.isfinite(loss_sum):
            return
        checkpointer, step = self.parts.checkpointer, run.step
        latest = checkpointer.latest if checkpointer is not None else "in --logdir"
        raise failures.NonFinite(
            f"the training loss is {loss_sum} in steps {step - steps + 1}"
            f"..{step}, so no checkpoint is written for them; " + (
                f"rerun with the same --logdir and a lower --learning_rate to resume "
                f"from the last checkpoint ({latest})" if latest else
                "no checkpoint was written yet: rerun with a lower --learning_rate"))

    def _maybe_write_summary(self, run: Progress) -> None:
        """Every summary_every steps, and where the input ended: the window's means, the
        learning rate, the monitor's scalars."""
        parts, step, every = self.parts, run.step, self.plan.summary_every
        if parts.summaries is None or not every or not (step % every == 0 or run.input_ended):
            return
        metrics = run.summary_window.means(self.plan.global_batch)
        if parts.learning_rate is not None:
            metrics["learning_rate"] = parts.learning_rate(step)
        if parts.monitor is not None:
            metrics.update(parts.monitor.scalars(step))
        parts.summaries.scalars(step, metrics)
        run.summary_window = run.window()

    def _maybe_log(self, run: Progress) -> None:
        """Every log_every steps, at train_steps and where the input ended: one line."""
        step, every, train_steps = run.step, self.plan.log_every, self.plan.train_steps
        if not every or not (step % every == 0 or step == train_steps or run.input_ended):
            return
        metrics = run.log_window.means(self.plan.global_batch)
        logging.info("step %d/%d  loss %.4f%s  %s  input wait %.1f ms/step  %s", step,
                     train_steps, metrics["loss"],
                     metrics_lib.log_text(metrics, self.parts.trainer.metrics),
                     _speed_text(metrics), 1e3 * metrics["input_wait"],
                     _eta_text(metrics, train_steps - step))
        run.log_window = run.window()

    def _maybe_save_checkpoint(self, step: int) -> None:
        every = self.plan.checkpoint_every
        if self.parts.checkpointer is not None and every and step % every == 0:
            self.parts.checkpointer.save(step)

    def _monitor_after_loop(self, step: int) -> None:
        """The monitor's evals, histograms, profiles and breakdowns due at `step`."""
        if self.parts.monitor is not None:
            self.parts.monitor.after_loop(step)

    def _should_end(self, run: Progress) -> bool:
        """A callback said stop (before train_steps), the input ended, or a stop was asked."""
        parts, step, train_steps = self.parts, run.step, self.plan.train_steps
        if parts.callbacks:
            run.stopped_by = _call_back(parts.callbacks, step,
                                        run.last.means(self.plan.global_batch), parts.monitor)
            if run.stopped_by is not None and step < train_steps:
                return True
            run.stopped_by = None  # at train_steps: the train ends there anyway
        if run.input_ended:
            return True
        if parts.should_stop is not None and step < train_steps and parts.should_stop():
            run.stopped = True
            return True
        return False

    def _save_final_checkpoint(self, run: Progress) -> None:
        """At the last step trained, unless the interval's checkpoint is already there."""
        every = self.plan.checkpoint_every
        if self.parts.checkpointer is not None and run.step > run.start and not (
                every and run.step % every == 0):
            self.parts.checkpointer.save(run.step)

    def _result(self, run: Progress) -> FitResult:
        """The train's result; one warning if no step was timed."""
        steady, batch = run.steady, self.plan.global_batch
        if run.step > run.start and not steady.timed_steps:
            logging.warning("no step time was measured: the run trained %d step(s) after %d, "
                            "and the first (it traces the loop) is not timed; examples/sec and "
                            "the link model's compute and modelled step times are left out "
                            "(train at least 2 steps for them)", run.step - run.start, run.start)
        times = run.per_step_times
        return FitResult(
            start_step=run.start, final_step=run.step,
            train=run.last.means(batch) if run.last.steps else {},
            median_step_time=float(np.median(times.items)) if times else None,
            examples_per_sec=(steady.timed_steps * batch / steady.seconds
                              if steady.timed_steps and steady.seconds > 0 else None),
            input_wait=steady.input_wait / steady.steps if steady.steps else None,
            input_wait_fraction=steady.input_wait / steady.seconds if steady.steps else None,
            loop_seconds=run.loop_seconds, traced_step_seconds=run.traced_step,
            input_ended=run.input_ended, stopped=run.stopped, stopped_by=run.stopped_by)


def _next_boundary(step: int, every: int) -> int | None:
    return (step // every + 1) * every if every > 0 else None


def _speed_text(metrics: dict) -> str:
    if metrics["examples_per_sec"] is None:
        return "speed not measured (the first step traces)"
    return f"{metrics['examples_per_sec']:.0f} examples/sec"


def _eta_text(metrics: dict, steps_left: int) -> str:
    return "" if metrics["step_time"] is None else f"ETA {steps_left * metrics['step_time']:.0f}s"


def _call_back(callbacks, step: int, train: dict, monitor):
    """Calls every callback with the loop's metrics; the first that says stop, or None."""
    values = {f"train/{k}": v for k, v in train.items()}
    last_eval = getattr(monitor, "last_eval", None)
    if last_eval is not None and last_eval[0] == step:
        values.update({f"eval/{k}": v for k, v in last_eval[1].items()})
    stop = None
    for callback in callbacks:
        if callback(step, dict(values)) and stop is None:
            stop = callback
    return stop
