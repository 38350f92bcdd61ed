"""N towers compute what one device computes on the same global batch.

Each aggregation mode, for 1, 2 and 4 towers and for the MLP and the CNN, is
trained 5 steps under --deterministic and compared with third_party's
single-device step (a plain tf.GradientTape over the whole global batch).
Tolerance: rtol 1e-5, with atol 1e-6 for weights that pass through zero, where
a relative bound means nothing; the towers sum the same numbers in another
order, so only float32 rounding separates them.
"""

import numpy as np
import pytest

from mgloop import aggregation
from tests import helpers

MODES = ["ps_cpu", "reduce_broadcast", "ring"]
RTOL, ATOL = 1e-5, 1e-6
STEPS = 5


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(config):
        key = (config.model, config.optimizer, config.lr_schedule, config.weight_decay)
        if key not in cache:
            cache[key] = helpers.train_reference(config, helpers.batches(STEPS))
        return cache[key]
    return get


def assert_weights_close(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
@pytest.mark.parametrize("towers", [1, 2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_towers_equal_single_device(mode, towers, model, reference, logdir):
    config = helpers.small_config(logdir, devices=f"cpu:{towers}", aggregation=mode, model=model)
    trainer, loss_sum = helpers.train_mgloop(config, helpers.batches(STEPS))
    expected_weights, expected_loss_sum = reference(config)
    copies = helpers.copy_weights(trainer)
    layout = aggregation.get(mode).layout
    assert len(copies) == (towers if layout == aggregation.REPLICATED else 1)
    for weights in copies:
        assert_weights_close(weights, expected_weights)
    np.testing.assert_allclose(loss_sum, expected_loss_sum, rtol=RTOL)
    # The weights moved: equality with the reference is not equality with the start.
    initial = helpers.train_mgloop(helpers.small_config(logdir, model=model), [])[0]
    assert any(np.abs(w - w0).max() > 1e-3
               for w, w0 in zip(copies[0], helpers.copy_weights(initial)[0]))


@pytest.mark.parametrize("mode", ["reduce_broadcast", "ring"])
def test_replicas_stay_bit_identical(mode, logdir):
    config = helpers.small_config(logdir, devices="cpu:4", aggregation=mode)
    trainer, _ = helpers.train_mgloop(config, helpers.batches(8))
    copies = helpers.copy_weights(trainer)
    for replica in copies[1:]:
        for a, b in zip(replica, copies[0]):
            np.testing.assert_array_equal(a, b)
    devices = {copy.trainable[0].device for copy in trainer.copies}
    assert len(devices) == 4  # one copy on each tower's device


@pytest.mark.parametrize("optimizer,schedule,weight_decay", [
    ("sgd", "poly", 0.0), ("adam", "cosine", 0.0), ("momentum", "constant", 1e-3)])
def test_optimizers_and_schedules_equal_single_device(optimizer, schedule, weight_decay,
                                                      reference, logdir):
    config = helpers.small_config(logdir, devices="cpu:4", aggregation="ring",
                                  optimizer=optimizer, lr_schedule=schedule,
                                  learning_rate=0.01 if optimizer == "adam" else 0.1,
                                  weight_decay=weight_decay, train_steps=8)
    trainer, _ = helpers.train_mgloop(config, helpers.batches(STEPS))
    expected_weights, _ = reference(config)
    for weights in helpers.copy_weights(trainer):
        assert_weights_close(weights, expected_weights)
