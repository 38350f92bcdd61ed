"""What a gradient-aggregation method may touch: the towers' gradients, and nothing else.

- Non-trainable state (batch-norm moving statistics) is averaged by mgloop's exact
  path (mgloop/non_trainable.py), never by the method: with a method that zeroes
  everything it reduces, the moving statistics are still the mean of the shard
  statistics (checked against numpy), and the method never sees those variables.
- `Trainer.time_exchange` (mgloop/exchange_timing.py) leaves a method's state
  (here an error-feedback-like residual) as training left it.

Tolerance of the moving statistics: rtol 1e-5, atol 1e-6, as tests/test_batch_norm.py
(float32 moments of 4 rows against float64 numpy, sums in another order: a few
units of float32 rounding, u = 6e-8, relative to the values).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.parameter_server import ParameterServerCpu
from mgloop.aggregation.ring import Ring
from tests import helpers

RTOL, ATOL = 1e-5, 1e-6
STEPS, TOWERS, MOMENTUM = 3, 4, 0.5


class _Zeroing:
    """Mixin: the registered method's reduce, with every result replaced by zeros (a
    deliberately lossy method); remembers every variable it was handed."""

    seen: list = []

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


@register
class ZeroingPs(_Zeroing, ParameterServerCpu):
    name = "test_zeroing_ps_cpu"


@register
class ResidualRing(Ring):
    """Ring whose state, like error feedback's residual, changes in every reduce: the
    running sum of the averaged gradients of the first variable."""

    name = "test_residual_ring"
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
    mean, variance = np.zeros(features), np.ones(features)
    batches = helpers.batches(STEPS)
    helpers.run_batches(trainer, batches)
    for x, _ in batches:
        shards = np.split(x.reshape(len(x), -1).astype(np.float64), TOWERS)
        mean = MOMENTUM * mean + (1 - MOMENTUM) * np.mean([s.mean(0) for s in shards], 0)
        variance = MOMENTUM * variance + (1 - MOMENTUM) * np.mean([s.var(0) for s in shards], 0)
    for copy in trainer.copies:
        np.testing.assert_allclose(copy.non_trainable[0].numpy(), mean, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(copy.non_trainable[1].numpy(), variance, rtol=RTOL,
                                   atol=ATOL)
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
