"""What a gradient-aggregation method may touch: the towers' gradients, and nothing else.

- Non-trainable state (batch-norm moving statistics) is averaged by mgloop's exact
  path (mgloop/step/non_trainable.py), never by the method: with a method that zeroes
  everything it reduces, the moving statistics are still the mean of the shard
  statistics (checked against numpy), and the method never sees those variables.
- `Trainer.time_exchange` (mgloop/step/exchange_timing.py) leaves a method's state
  (here an error-feedback-like residual) as training left it.

Tolerance of the moving statistics: tolerance.MovingMomentsBound with h = the flattened
inputs (no rounding in h): each shard's float32 mean and variance of its 4 rows, their
average over the towers and the moving update, against the exact (float64) values,
as the per-tower test of tests/test_batch_norm.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.dense.parameter_server import ParameterServerCpu
from mgloop.aggregation.dense.ring import Ring
from tests import helpers, tolerance

STEPS, TOWERS, MOMENTUM = 3, 4, 0.5


class _Zeroing:
    """Mixin: the registered method's reduce, with every result replaced by zeros (a
    deliberately lossy method); remembers every variable it was handed."""

    seen: list = []  # (each subclass declares exact=False: lossy, ||0 - (1/T) sum_t g_t||
    # <= max_t ||g_t||)

    @classmethod
    def error_bound(cls, options, num_towers):
        return 1.0

    def reduce(self, tower_values, variables, average=True):
        _Zeroing.seen.extend(variables)
        out = super().reduce(tower_values, variables, average)
        zeroed = []
        for values in out:
            row = []
            for value in values:
                with tf.device(value.device):
                    row.append(tf.zeros_like(value))
            zeroed.append(row)
        return zeroed


@register
class ZeroingRing(_Zeroing, Ring):
    name = "test_zeroing_ring"
    capabilities = Ring.capabilities.but(exact=False)


@register
class ZeroingPs(_Zeroing, ParameterServerCpu):
    name = "test_zeroing_ps_cpu"
    capabilities = ParameterServerCpu.capabilities.but(exact=False)


@register
class ResidualRing(Ring):
    """Ring whose state, like error feedback's residual, changes in every reduce: the
    running sum of the averaged gradients of the first variable."""

    name = "test_residual_ring"
    # state per variable: its gradients must not be packed into buckets
    capabilities = Ring.capabilities.but(summable=False)
    residual = None

    def reduce(self, tower_values, variables, average=True):
        out = super().reduce(tower_values, variables, average)
        if self.residual is None:
            with tf.init_scope(), tf.device(self.parameter_devices()[0]):
                self.residual = tf.Variable(tf.zeros(variables[0].shape), trainable=False)
        self.residual.assign_add(out[0][0])
        return out


def bn_first_model():
    """Batch norm straight on the inputs: its statistics do not depend on the weights."""
    return keras.Sequential([
        keras.Input(helpers.DATASET.input_shape), keras.layers.Flatten(),
        keras.layers.BatchNormalization(momentum=MOMENTUM), keras.layers.Dense(10)])


@pytest.mark.parametrize("aggregation,transport", [("test_zeroing_ring", "bfloat16"),
                                                   ("test_zeroing_ps_cpu", "float32")])
def test_moving_statistics_bypass_the_method(aggregation, transport, tmp_path):
    config = helpers.small_config(str(tmp_path), devices=f"cpu:{TOWERS}",
                                  aggregation=aggregation, transport_dtype=transport)
    _Zeroing.seen.clear()
    trainer = helpers.build_trainer(config, bn_first_model)
    features = trainer.model.layers[0].output.shape[-1]  # the flattened inputs
    exact = tolerance.MovingMomentsBound(MOMENTUM, features)  # float64 values, float32 bound
    batches = helpers.batches(STEPS)
    helpers.run_batches(trainer, batches)
    for x, _ in batches:
        exact.update(x, None, None, groups=TOWERS)  # the mean of the shards' statistics
    for copy in trainer.copies:
        tolerance.assert_within([v.numpy() for v in copy.non_trainable[:2]],
                                [exact.mean, exact.variance],
                                [exact.mean_bound, exact.variance_bound])
    assert _Zeroing.seen  # the method did reduce the gradients
    state = trainer.copies[0].non_trainable
    assert not any(v is s for v in _Zeroing.seen for s in state)


def test_exchange_timing_leaves_the_method_state(tmp_path):
    config = helpers.small_config(str(tmp_path), devices=f"cpu:{TOWERS}",
                                  aggregation="test_residual_ring")
    trainer = helpers.build_trainer(config)
    helpers.run_batches(trainer, helpers.batches(STEPS))
    residual = trainer.aggregation.residual
    trained = residual.numpy()
    assert np.abs(trained).max() > 0  # the steps did update it
    assert trainer.time_exchange(repeats=1, per_call=2) > 0
    np.testing.assert_array_equal(residual.numpy(), trained)
    helpers.run_batches(trainer, helpers.batches(1))  # and training goes on from it
    assert not np.array_equal(residual.numpy(), trained)
