"""Callbacks between compiled loops (Orbit's actions): functions of (step, metrics).

`Controller.train` calls every callback after each compiled loop, in order, as

    callback(step, metrics) -> stop?

with `step` the global step reached and `metrics` that loop's values: "train/loss" (the
mean loss over the loop's steps) and "train/NAME" for each metric (metrics.py, summed
over the loop's towers and steps), and, on a loop after which an eval ran
(--eval_every, every loop boundary on its multiples), "eval/loss" and "eval/NAME". A
truthy return ends training there: the fit saves its checkpoint, and the run evaluates,
exports and writes summary.json as at --train_steps (summary["stopped_by"] names the
callback). Several workers call their callbacks with the same values (train metrics are
merged across workers; every worker evaluates the same data with the same weights), so a
callback that decides from them alone decides the same on every worker. Loops end on
--steps_per_loop, --eval_every, summary and log boundaries: a callback runs at least once
per --steps_per_loop steps.
"""

from __future__ import annotations

import math

from absl import logging

from mgloop.errors import ConfigError
from mgloop.runs.thinned import Thinned


class EarlyStopping:
    """Stops when the eval metric `monitor` (e.g. "eval/loss", "eval/accuracy") has not
    improved for `patience` evals: improved means below best - min_delta (mode "min") or
    above best + min_delta (mode "max"). Acts only on loops that evaluated."""

    def __init__(self, monitor: str = "eval/loss", patience: int = 0, mode: str = "min",
                 min_delta: float = 0.0):
        if mode not in ("min", "max"):
            raise ConfigError(f"EarlyStopping: mode={mode!r}; valid: 'min', 'max'")
        if patience < 0 or min_delta < 0:
            raise ConfigError(f"EarlyStopping: patience={patience}, min_delta={min_delta}; "
                              "both must be >= 0")
        self.monitor, self.patience, self.mode, self.min_delta = monitor, patience, mode, min_delta
        self.best, self.best_step, self.waited = math.inf if mode == "min" else -math.inf, None, 0
        self.stopped_step = None

    def __repr__(self) -> str:
        return f"EarlyStopping({self.monitor!r}, patience={self.patience}, mode={self.mode!r})"

    def __call__(self, step: int, metrics: dict) -> bool:
        if self.monitor not in metrics:
            return False
        value = metrics[self.monitor]
        better = (value < self.best - self.min_delta if self.mode == "min"
                  else value > self.best + self.min_delta)
        if better:
            self.best, self.best_step, self.waited = value, step, 0
            return False
        self.waited += 1
        if self.waited > self.patience:
            self.stopped_step = step
            logging.info("early stopping at step %d: %s has not improved on %.6g (step %s) "
                         "for %d evals", step, self.monitor, self.best, self.best_step,
                         self.waited)
            return True
        return False


HISTORY_LIMIT = 1024  # records a History holds at most (~1.5 KiB each)


class History:
    """Keeps the records {"step": s, **metrics} of the loops that evaluated and of those
    ending on a multiple of `every` steps (0: every loop), in `records`; a long run with
    short loops keeps what its summaries keep, not one record per loop. At most `limit`
    records are held (thinned.py): past that, every other one is dropped and from then on
    one record in 2, 4, ... is kept, evenly over the run, so a run of days keeps a few
    MiB, not one record per summary window (TensorBoard has every window)."""

    def __init__(self, every: int = 0, limit: int | None = None):
        self.every = every
        self._kept = Thinned(HISTORY_LIMIT if limit is None else limit)

    @property
    def records(self) -> list[dict]:
        return self._kept.items

    @property
    def stride(self) -> int:
        """One record in `stride` of those made is kept (1 until `limit` were made)."""
        return self._kept.stride

    def __call__(self, step: int, metrics: dict) -> bool:
        if not self.every or step % self.every == 0 or any(k.startswith("eval/")
                                                           for k in metrics):
            self._kept.append({"step": step, **metrics})
        return False

    def of(self, name: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric, e.g. "eval/loss", where it was recorded."""
        pairs = [(r["step"], r[name]) for r in self.records if name in r]
        return [s for s, _ in pairs], [v for _, v in pairs]


def check(callbacks, eval_every: int, evaluates: bool = True) -> None:
    """Refuses an EarlyStopping on an eval metric that no eval during training would feed
    (--eval_every=0, or no eval data): it would never act (one line)."""
    for callback in callbacks or ():
        if isinstance(callback, EarlyStopping) and callback.monitor.startswith("eval/"):
            if not eval_every:
                raise ConfigError(f"callbacks: {callback!r} watches an eval metric, but "
                                  "--eval_every=0 evaluates only after training; set "
                                  "--eval_every=N (steps between evals)")
            if not evaluates:
                raise ConfigError(f"callbacks: {callback!r} watches an eval metric, but the "
                                  "run has no eval data; give eval_data=")


def name_of(callback) -> str:
    return repr(callback) if isinstance(callback, EarlyStopping) else getattr(
        callback, "__name__", type(callback).__name__)
