"""Dynamic loss scaling as a hook (`--mixed_precision=mixed_float16`; precision.py).

Unit u (a tower; the host for the single-loss step) reads S from the copy it computes
with, on its own device, once per step (`step_scope`); differentiates S * loss_u
(`scale_loss`) and divides its gradients by S (`unscale`). `may_apply` counts this
worker's units whose gradients are not finite (on the host); the count rides with the
step's metrics in the exchange (`to_all_workers`), which sums it over every worker;
`from_all_workers` forms all_finite = (sum == 0), the same on every worker (precision.py
says why a count and not the exchanged gradient), and sends it to every copy, whose
update the guard runs only then (`DynamicLossScale.apply_if_finite`: skipped, the scale
halved).

A skipped step leaves the method's state as it was too: `may_apply` reads every
state variable of the aggregation (error-feedback residuals, PowerSGD's Q, DGC's
momenta, exchange counters, stale buffers) before the exchange, on its own device,
and `after_exchange` writes v_before back when not all_finite (one `tf.cond`): a read of
the state per step and a write only on a skipped step, only with loss scaling. Without it, a non-finite
gradient would leave inf or NaN in a residual that every later step sends on
(experiments/soak.py found one at its first checkpoint). State a method changes after the
update (`after_update`: local SGD's and DiLoCo's synchronisation) is not rolled back.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from mgloop import phases
from mgloop.step import precision
from mgloop.step.hooks import Hook


class LossScaling(Hook):
    def __init__(self, scales: list[precision.DynamicLossScale], aggregation,
                 unit_devices: list[str], copy_of_unit: list[int], copy_devices: list[str]):
        self.scales = scales  # one per variable copy
        self.aggregation = aggregation
        self.units, self.copy_of_unit = list(unit_devices), list(copy_of_unit)
        self.copy_devices = list(copy_devices)
        self._read: list[tf.Tensor] = []  # this step's S on each unit
        self._bad: tf.Tensor | None = None  # this step's count of this worker's bad units
        # this step's all_finite on each copy's device and the method's state before the
        # exchange
        self._finite: list[tf.Tensor] | None = None
        self._state_before: list[tuple[tf.Variable, tf.Tensor]] = []

    @contextlib.contextmanager
    def step_scope(self):
        with tf.name_scope(phases.COMPUTE):
            self._read = [self.aggregation.send(self.scales[c].read(), self.scales[c].device, d)
                          for c, d in zip(self.copy_of_unit, self.units)]
        yield

    def scale_loss(self, t, loss):
        return loss * self._read[t]

    def unscale(self, t, grads):
        return [None if g is None else g / self._read[t] for g in grads]

    def may_apply(self, grads):
        self._bad = precision.non_finite_units(grads, self.units, self.aggregation)
        self._finite = None
        self._state_before = []
        for v in self.aggregation.state_variables:  # read before the exchange writes it
            with tf.device(v.device):
                self._state_before.append((v, v.read_value()))

        def guard(copy: int, update) -> None:
            self.scales[copy].apply_if_finite(self._agreed()[copy], update)
        return guard

    def to_all_workers(self) -> list[tf.Tensor]:
        return [self._bad]

    def from_all_workers(self, sums: list[tf.Tensor]) -> None:
        self._finite = precision.agreed_finite(sums[0], self.aggregation, self.copy_devices)

    def _agreed(self) -> list[tf.Tensor]:
        if self._finite is None:  # a step that forgot to exchange the count
            raise RuntimeError("loss scaling: the step applied its update before the count "
                               "of non-finite units came back (Hooks.from_all_workers)")
        return self._finite

    def after_exchange(self, grads) -> list:
        """On a skipped step, every state variable of the method takes back its value
        from before the exchange (the exchange has run: its writes come first)."""
        before, self._state_before = self._state_before, []
        if not before:
            return []

        def restore():
            for v, value in before:
                with tf.device(v.device):
                    v.assign(value)
            return tf.constant(True)
        return [tf.cond(self._agreed()[0], lambda: tf.constant(False), restore)]

    def current(self) -> float:
        """The scale now (the same on every copy)."""
        return float(self.scales[0].scale.numpy())
