"""What the outer loop sums between its actions, and how it times a compiled loop.

A `Window` sums the loops since an action (the last summary, the last log line): their
steps, loss, metric states, timed seconds and input wait, and the last sampled
statistics; `Progress` holds the windows and what else one `Controller.train` has done
so far. `run_loop` runs one compiled loop of a Trainer and says which of its steps
were timed: the run's first loop runs its first step alone (the call that traces and
first runs the compiled loop), then its other steps, so that every speed is taken over
the steps after the traced one.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

from mgloop.runs.loop import LoopResult
from mgloop.runs.thinned import Thinned
from mgloop.runs.trainer import Trainer
from mgloop.training import metrics as metrics_lib


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
class TimedLoop:
    """One compiled loop as the outer loop accounts for it."""

    result: LoopResult  # all of its steps
    timed: LoopResult | None  # the steps after the run's first (traced) one; None: none
    seconds: float  # of the timed steps
    traced_seconds: float  # of the run's first step (0 in any later loop)

    @property
    def timed_steps(self) -> int:
        return self.timed.steps if self.timed is not None else 0


def run_loop(trainer: Trainer, iterator, num: int, sample: bool, first: bool) -> TimedLoop:
    """One loop of `num` steps. The run's first loop (`first`) runs its first step alone
    (the call that traces the compiled loop), then the others; the two results are one
    loop's."""
    traced_seconds, traced = 0.0, None
    if first:
        began = time.perf_counter()
        traced = trainer.train_loop(iterator, 1, sample_stats=sample and num == 1)
        traced_seconds = time.perf_counter() - began
        num -= 1
        if traced.steps < 1 or num == 0:
            return TimedLoop(traced, None, 0.0, traced_seconds)
    began = time.perf_counter()
    timed = trainer.train_loop(iterator, num, sample_stats=sample)
    seconds = time.perf_counter() - began
    if traced is None:
        return TimedLoop(timed, timed, seconds, 0.0)
    result = LoopResult(
        steps=traced.steps + timed.steps, loss_sum=traced.loss_sum + timed.loss_sum,
        metric_sums={name: traced.metric_sums[name] + timed.metric_sums[name]
                     for name in timed.metric_sums},
        input_wait=traced.input_wait + timed.input_wait, stats=timed.stats)
    return TimedLoop(result, timed, seconds, traced_seconds)


@dataclasses.dataclass
class Progress:
    """What a `train` has done so far."""

    start: int  # the trainer's step when it began
    step: int
    iterator: Iterator  # the staged global batches
    metrics: list  # the trainer's metric objects, which every window sums
    summary_window: Window  # since the last summary
    log_window: Window  # since the last log line
    last: Window  # the last loop
    steady: Window  # every timed loop before the input ended
    # seconds per step of each loop after the first, an even sample (thinned.py)
    per_step_times: Thinned
    loop_seconds: float = 0.0  # all loops, tracing included
    first_loop: bool = True
    traced_step: float | None = None  # the seconds of the run's first step
    input_ended: bool = False
    stopped: bool = False
    stopped_by: object = None

    def window(self) -> Window:
        return Window(self.metrics)

    def count_time(self, loop: TimedLoop) -> None:
        """Every loop's seconds, tracing included; the traced step's on the first loop."""
        self.loop_seconds += loop.seconds + loop.traced_seconds
        if self.first_loop:
            self.traced_step = loop.traced_seconds

    def add(self, loop: TimedLoop) -> None:
        """A loop that ran steps: its steps, its timing, its sums in every window."""
        if loop.timed_steps and not self.input_ended:  # (a whole loop's time)
            self.per_step_times.append(loop.seconds / loop.timed_steps)
            self.steady.add(loop.timed, loop.seconds)
        self.first_loop = False
        self.step += loop.result.steps
        for window in (self.summary_window, self.log_window):
            window.add(loop.result, loop.seconds, loop.timed_steps)
        self.last = self.window()
        self.last.add(loop.result, loop.seconds, loop.timed_steps)
