"""The outer loop: runs a Trainer's compiled loops from its step to `train_steps`.

Python runs here once per compiled loop (`Trainer.train_loop`), never per step.
`fit` chooses each loop's length so that summaries, log lines, checkpoints and
the monitor's events fall exactly on their step boundaries, sums the loops'
results into windows (since the last summary, since the last log line), and
reports speed without tracing: the first loop runs its first step alone (the call
that traces and first runs the compiled loop) and then its other steps, one loop for
every window, summary and callback, and every speed (examples/sec, step time, the
median step a link model's compute comes from) is taken over the steps after that
first one. A run of one step has nothing but the traced step: it reports no speed
(None) and says so in one log line. Summaries, checkpoints and the monitor are
injected, as in Orbit's controller.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

from absl import logging
import numpy as np
import tensorflow as tf

from mgloop.runs import failures
from mgloop.runs.loop import LoopResult
from mgloop.runs.thinned import Thinned
from mgloop.runs.trainer import Trainer
from mgloop.settings import in_range
from mgloop.spec import metrics as metrics_lib


LOOP_TIMES_LIMIT = 4096  # loop times the median step time is taken over, at most


@dataclasses.dataclass
class Window:
    """Running sums of a metric window (since the last summary or log line)."""

    metrics: list = dataclasses.field(default_factory=list)  # metric objects (metrics.py)
    steps: int = 0
    loss_sum: float = 0.0
    metric_sums: dict = dataclasses.field(default_factory=dict)  # name -> summed state
    seconds: float = 0.0  # of the timed steps
    timed_steps: int = 0  # the steps timed: all but the first (traced) step of the run
    input_wait: float = 0.0
    stats: dict[str, float] = dataclasses.field(default_factory=dict)  # the last sample

    def add(self, result: LoopResult, seconds: float, timed_steps: int | None = None) -> None:
        """Adds a loop's sums; `seconds` is the time of its `timed_steps` (default: all of
        its steps)."""
        if result.stats:
            self.stats = dict(result.stats)
        self.steps += result.steps
        self.timed_steps += result.steps if timed_steps is None else timed_steps
        self.loss_sum += result.loss_sum
        for name, sums in result.metric_sums.items():
            self.metric_sums[name] = self.metric_sums.get(name, 0.0) + sums
        self.seconds += seconds
        self.input_wait += result.input_wait

    def means(self, global_batch: int) -> dict[str, float | None]:
        """The window's metrics: the mean loss, and each metric (e.g. accuracy) where it is
        defined on the window's summed states; the speeds over its timed steps (None: none
        was timed)."""
        timed = self.timed_steps > 0 and self.seconds > 0
        return {"loss": self.loss_sum / self.steps,
                **metrics_lib.results(self.metrics, self.metric_sums),
                "examples_per_sec": (self.timed_steps * global_batch / self.seconds
                                     if timed else None),
                "step_time": self.seconds / self.timed_steps if timed else None,
                "input_wait": self.input_wait / self.steps,
                **self.stats}


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


def check_settings(config) -> None:
    """--train_steps, --steps_per_loop and the intervals of summaries and log lines."""
    in_range("train_steps", config.train_steps, low=0)
    in_range("steps_per_loop", config.steps_per_loop, low=1)
    in_range("summary_every", config.summary_every, low=0)
    in_range("log_every", config.log_every, low=0)


def _next_boundary(step: int, every: int) -> int | None:
    return (step // every + 1) * every if every > 0 else None


def fit(trainer: Trainer, batches: tf.data.Dataset, train_steps: int, global_batch: int,
        steps_per_loop: int, summary_every: int = 0, log_every: int = 0,
        checkpoint_every: int = 0, summaries=None, checkpointer=None,
        learning_rate: Callable[[int], float] | None = None, monitor=None,
        should_stop: Callable[[], bool] | None = None,
        callbacks: Sequence[Callable[[int, dict], bool]] = ()) -> FitResult:
    """Runs `trainer` from its current step to `train_steps` on `batches`.

    `batches` yields the global batches from the trainer's current step on;
    the fit reads at most `train_steps - start` of them (so staging drains at
    the end instead of holding batches no step will use) and stops early if
    they run out. Whatever is still staged when the fit ends (or fails) is
    dropped: a later fit starts from a fresh iterator at its own step.
    Summaries (`summaries.scalars(step, dict)`), log lines and checkpoints
    (`checkpointer.save(step)`) are injected; each falls on multiples of its
    interval (0 = never), and a checkpoint is always written at the end.
    `monitor` (diagnostics.Monitor) adds loop boundaries (`stops(step)`), runs
    `before_loop(step)` / `after_loop(step)` around each loop, and adds scalars
    to each summary (`scalars(step)`). `should_stop()` is asked after every loop that
    does not end the fit (the same number of times on every worker); True ends the fit
    there, with its checkpoint (`FitResult.stopped`). `callbacks` (callbacks.py) are called
    after every loop with (step, that loop's "train/..." and, if it evaluated, "eval/..."
    metrics); one returning True ends the fit there (`FitResult.stopped_by`).
    """
    start = step = int(trainer.global_step.numpy())
    iterator = iter(trainer.staging.pipeline(batches.take(max(train_steps - start, 0))))
    new_window = functools.partial(Window, trainer.metrics)
    summary_window, log_window, steady, last = (new_window() for _ in range(4))
    # seconds per step of each loop after the first, an even sample (thinned.py)
    per_step_times = Thinned(LOOP_TIMES_LIMIT)
    loop_seconds, first_loop, input_ended, traced_step = 0.0, True, False, None
    stopped, stopped_by = False, None
    try:
        while step < train_steps:
            stops = [train_steps, step + steps_per_loop] + [
                b for b in (_next_boundary(step, summary_every), _next_boundary(step, log_every),
                            _next_boundary(step, checkpoint_every)) if b is not None]
            if monitor is not None:
                stops += [b for b in monitor.stops(step) if b > step]
                monitor.before_loop(step)
            num = min(stops) - step
            # --diagnostics: gradient statistics of the last step of each summary window only
            sample = bool(summary_every) and (step + num) % summary_every == 0
            result, timed, seconds, traced_seconds = _run_loop(trainer, iterator, num, sample,
                                                               first_loop)
            loop_seconds += seconds + traced_seconds
            if first_loop:
                traced_step = traced_seconds
            timed_steps = timed.steps if timed is not None else 0
            if result.steps < num:
                input_ended = True
                logging.warning("the input ended after step %d of %d", step + result.steps,
                                train_steps)
            if not result.steps:
                break
            if timed_steps and not input_ended:  # (a whole loop's time)
                per_step_times.append(seconds / timed_steps)
                steady.add(timed, seconds)
            first_loop = False
            step += result.steps
            if not np.isfinite(result.loss_sum):  # before any summary or checkpoint of it
                latest = checkpointer.latest if checkpointer is not None else "in --logdir"
                raise failures.NonFinite(
                    f"the training loss is {result.loss_sum} in steps {step - result.steps + 1}"
                    f"..{step}, so no checkpoint is written for them; " + (
                        f"rerun with the same --logdir and a lower --learning_rate to resume "
                        f"from the last checkpoint ({latest})" if latest else
                        "no checkpoint was written yet: rerun with a lower --learning_rate"))
            for window in (summary_window, log_window):
                window.add(result, seconds, timed_steps)
            last = new_window()
            last.add(result, seconds, timed_steps)
            if summaries is not None and summary_every and (
                    step % summary_every == 0 or input_ended):
                metrics = summary_window.means(global_batch)
                if learning_rate is not None:
                    metrics["learning_rate"] = learning_rate(step)
                if monitor is not None:
                    metrics.update(monitor.scalars(step))
                summaries.scalars(step, metrics)
                summary_window = new_window()
            if log_every and (step % log_every == 0 or step == train_steps or input_ended):
                metrics = log_window.means(global_batch)
                logging.info("step %d/%d  loss %.4f%s  %s  input wait %.1f ms/step  %s", step,
                             train_steps, metrics["loss"],
                             metrics_lib.log_text(metrics, trainer.metrics), _speed_text(metrics),
                             1e3 * metrics["input_wait"], _eta_text(metrics, train_steps - step))
                log_window = new_window()
            if checkpointer is not None and checkpoint_every and step % checkpoint_every == 0:
                checkpointer.save(step)
            if monitor is not None:
                monitor.after_loop(step)
            if callbacks:
                stopped_by = _call_back(callbacks, step, last.means(global_batch), monitor)
                if stopped_by is not None and step < train_steps:
                    break
                stopped_by = None  # at train_steps: the fit ends there anyway
            if input_ended:
                break
            if should_stop is not None and step < train_steps and should_stop():
                stopped = True
                break
    finally:
        trainer.release_input()
    if checkpointer is not None and step > start and not (
            checkpoint_every and step % checkpoint_every == 0):
        checkpointer.save(step)
    if step > start and not steady.timed_steps:
        logging.warning("no step time was measured: the run trained %d step(s) after %d, and "
                        "the first (it traces the loop) is not timed; examples/sec and the "
                        "link model's compute and modelled step times are left out (train "
                        "at least 2 steps for them)", step - start, start)
    return FitResult(
        start_step=start, final_step=step,
        train=last.means(global_batch) if last.steps else {},
        median_step_time=float(np.median(per_step_times.items)) if per_step_times else None,
        examples_per_sec=(steady.timed_steps * global_batch / steady.seconds
                          if steady.timed_steps and steady.seconds > 0 else None),
        input_wait=steady.input_wait / steady.steps if steady.steps else None,
        input_wait_fraction=steady.input_wait / steady.seconds if steady.steps else None,
        loop_seconds=loop_seconds, traced_step_seconds=traced_step,
        input_ended=input_ended, stopped=stopped,
        stopped_by=stopped_by)


def _run_loop(trainer: Trainer, iterator, num: int, sample: bool, first: bool):
    """One loop of `num` steps: (its result, the result of its timed steps or None, their
    seconds, the seconds of the untimed first step). The run's first loop runs its first
    step alone (the call that traces the compiled loop), then the others; the two results
    are one loop's."""
    traced_seconds, traced = 0.0, None
    if first:
        began = time.perf_counter()
        traced = trainer.train_loop(iterator, 1, sample_stats=sample and num == 1)
        traced_seconds = time.perf_counter() - began
        num -= 1
        if traced.steps < 1 or num == 0:
            return traced, None, 0.0, traced_seconds
    began = time.perf_counter()
    timed = trainer.train_loop(iterator, num, sample_stats=sample)
    seconds = time.perf_counter() - began
    if traced is None:
        return timed, timed, seconds, 0.0
    result = LoopResult(
        steps=traced.steps + timed.steps, loss_sum=traced.loss_sum + timed.loss_sum,
        metric_sums={name: traced.metric_sums[name] + timed.metric_sums[name]
                     for name in timed.metric_sums},
        input_wait=traced.input_wait + timed.input_wait, stats=timed.stats)
    return result, timed, seconds, traced_seconds


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
