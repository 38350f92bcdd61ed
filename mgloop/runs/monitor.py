"""What the outer loop (`Controller.train`) does between compiled loops for inspection.

`Monitor` ends loops where it needs a boundary and acts there:

- every --summary_every steps, scalars beside the window means: `loss_scale`
  (mixed_float16) and `memory/...` (diagnostics.memory_scalars);
- every --eval_every steps: `eval/loss`, `eval/accuracy` on the held-out split;
- every --histogram_every steps: histograms `weights/<name>` of the template
  (variable copy 0) and `gradients/<name>`, the gradient copy 0 applied in the
  last step of the loop;
- --profile_steps=A,B: loops end at A and B; tf.profiler traces steps A+1 .. B
  into <logdir>/plugins/profile;
- every --breakdown_every steps: step k*N runs alone in its loop under the
  profiler and `breakdown/...` scalars split its time into compute, aggregation
  and apply (breakdown.py); skipped while a --profile_steps trace is running.

`logdir_guard` turns a logdir that disappears mid-run into one clear error,
after saving the checkpoint of the current step beside where the logdir was.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
from typing import Callable

from absl import logging
import tensorflow as tf

from mgloop.aggregation.local import async_run
from mgloop.errors import ConfigError
from mgloop.observe import breakdown
from mgloop.observe import diagnostics
from mgloop.runs.trainer import Trainer


def parse_profile_steps(value: str, train_steps: int) -> tuple[int, int]:
    """--profile_steps="A,B" -> (A, B) with 0 <= A < B <= train_steps."""
    parts = value.split(",")
    try:
        first, last = (int(p) for p in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        first = last = None
    if first is None or not 0 <= first < last <= train_steps:
        raise ConfigError(f"--profile_steps={value!r} must be two steps A,B with "
                          f"0 <= A < B <= --train_steps={train_steps} (the trace covers steps "
                          "A+1 .. B)")
    return first, last


class LogdirLost(RuntimeError):
    """The logdir disappeared during the run (the checkpoint was saved elsewhere)."""


class Monitor:
    def __init__(self, trainer: Trainer, train_writer, eval_writer,
                 evaluate: Callable[[], dict[str, float]], eval_every: int = 0,
                 histogram_every: int = 0,
                 profile_steps: tuple[int, int] | None = None, profile_dir: str | None = None,
                 breakdown_every: int = 0):
        self.trainer = trainer
        self.train_writer, self.eval_writer = train_writer, eval_writer
        self.evaluate = evaluate
        self.eval_every, self.histogram_every = eval_every, histogram_every
        self.profile_steps, self.profile_dir = profile_steps, profile_dir
        self.profiling = False
        self.breakdown_every = breakdown_every
        self.breakdown: breakdown.PhaseProfile | None = None  # profiling the current loop
        self.last_eval: tuple[int, dict[str, float]] | None = None

    def stops(self, step: int) -> list[int]:
        out = [(step // every + 1) * every for every in (self.eval_every, self.histogram_every)
               if every > 0]
        if self.breakdown_every:  # the profiled step runs alone in its loop
            following = (step // self.breakdown_every + 1) * self.breakdown_every
            out += [following - 1, following]
        return out + list(self.profile_steps or ())

    def before_loop(self, step: int) -> None:
        if self.profile_steps and step == self.profile_steps[0] and not self.profiling:
            tf.profiler.experimental.start(self.profile_dir)
            self.profiling = True
        if (self.breakdown_every and (step + 1) % self.breakdown_every == 0
                and not self.profiling):
            self.breakdown = breakdown.PhaseProfile()
            self.breakdown.start()

    def after_loop(self, step: int) -> None:
        if self.breakdown is not None:
            session, self.breakdown = self.breakdown, None
            seconds = session.stop()
            self.train_writer.scalars(step, {f"breakdown/{k}": v for k, v in seconds.items()})
            logging.info("step %d breakdown (profiled): %s", step, "  ".join(
                f"{k} {1e3 * v:.2f} ms" for k, v in seconds.items()))
        if self.profiling and step >= self.profile_steps[1]:
            self.stop_profile()
        if self.eval_every and step % self.eval_every == 0:
            self.eval_at(step)
        if self.histogram_every and step % self.histogram_every == 0:
            self.histograms(step)

    def scalars(self, step: int) -> dict[str, float]:
        values = diagnostics.memory_scalars(self.trainer.tower_devices)
        scale = self.trainer.loss_scale()
        if scale is not None:
            values["loss_scale"] = scale
        values.update(async_run.scalars(self.trainer.aggregation))  # async_diloco's merges
        return values

    def eval_at(self, step: int) -> dict[str, float]:
        """Evaluates at `step` (once per step) and writes eval/loss, eval/accuracy."""
        if self.last_eval is None or self.last_eval[0] != step:
            self.last_eval = (step, self.evaluate())
            self.eval_writer.scalars(step, self.last_eval[1])
        return self.last_eval[1]

    def histograms(self, step: int) -> None:
        copy = self.trainer.copies[0]
        values = {f"weights/{_name(v)}": v.numpy() for v in copy.trainable}
        if self.trainer.last_grads is not None:
            values.update({f"gradients/{_name(v)}": g.numpy()
                           for v, g in zip(copy.trainable, self.trainer.last_grads)})
        self.train_writer.histograms(step, values)

    def stop_profile(self) -> None:
        if self.breakdown is not None:  # the run failed inside a profiled step
            tf.profiler.experimental.stop()
            self.breakdown.discard()
            self.breakdown = None
        if self.profiling:
            self.profiling = False
            tf.profiler.experimental.stop()
            logging.info("profiler trace of steps %d..%d in %s", self.profile_steps[0] + 1,
                         self.profile_steps[1], self.profile_dir)


def _name(variable) -> str:
    return getattr(variable, "path", None) or variable.name.split(":")[0]


@contextlib.contextmanager
def logdir_guard(logdir: str, save_rescue: Callable[[str], str], stamp: str | None = None):
    """Any error while `logdir` is gone becomes LogdirLost, after `save_rescue(folder)`
    has saved the checkpoint into `<logdir>.rescued-<stamp>` (beside the lost logdir, or
    under the temp dir if its parent is gone too). `stamp`: the same on every worker of a
    job, so that each saves its node's part into one folder (default: the time)."""
    try:
        yield
    except Exception as error:
        if os.path.isdir(logdir):
            raise
        stamp = stamp or datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        parent = os.path.dirname(os.path.normpath(logdir))
        name = f"{os.path.basename(os.path.normpath(logdir))}.rescued-{stamp}"
        rescue = os.path.join(parent if os.path.isdir(parent) else tempfile.gettempdir(), name)
        os.makedirs(rescue, exist_ok=True)
        path = save_rescue(rescue)
        raise LogdirLost(f"--logdir={logdir} disappeared during the run "
                         f"({type(error).__name__}); the checkpoint is kept in {path}: resume "
                         f"with --logdir={rescue}") from None
