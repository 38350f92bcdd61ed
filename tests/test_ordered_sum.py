"""--ordered_sum_bytes: large gradients summed tower by tower (mgloop/step/ordered_sum.py)."""

import keras
import pytest
import tensorflow as tf

from mgloop.step.hooks.large_gradients import OrderedSumHook
from tests import helpers
from tests import tolerance

STEPS = 5


@pytest.mark.parametrize("mode", ["ps_cpu", "ps_spread"])  # one home; a home per variable
def test_ordered_sum_of_every_variable_equals_single_device(mode, logdir):
    """Threshold 1 byte: every gradient takes the ordered path, on 4 towers."""
    config = helpers.small_config(logdir, devices="cpu:4", aggregation=mode,
                                  ordered_sum_bytes=1)
    trainer, loss_sum = helpers.train_mgloop(config, helpers.batches(STEPS))
    order = trainer.step.hooks.find(OrderedSumHook)
    assert order is not None and order.indices == list(range(len(trainer.copies[0].trainable)))
    expected = helpers.train_reference_bounded(config, helpers.batches(STEPS))
    tolerance.assert_matches_reference(helpers.copy_weights(trainer)[0], loss_sum, expected)


WIDE = 8192  # the wide layer's kernel: 192 x 8192 float32 = 6 MiB


def wide_model():
    return keras.Sequential([keras.Input(helpers.DATASET.input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(WIDE, activation="relu"),
                             keras.layers.Dense(helpers.DATASET.num_classes)])


def step_peak_bytes(trainer, batch) -> int:
    """Bytes the host allocator holds at the peak of one step beyond what it held before."""
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    helpers.run_batches(trainer, [batch])
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - before


def test_ordered_sum_holds_two_copies_of_a_large_gradient_instead_of_all(logdir):
    """4 towers: the unordered sum needs all 4 gradients of the 6 MiB kernel at once (AddN's
    inputs); the ordered one the running sum and one tower's gradient. Same weights.

    Two kernels fewer in principle; the peak is asserted at least one kernel lower,
    because the allocator's peak counts whole chunks (it hands out a free chunk of
    up to twice the request), and that slack depends on what earlier tests left."""
    batches = helpers.batches(2)
    trainers = {}
    for threshold in (0, 2 ** 20):
        config = helpers.small_config(logdir, devices="cpu:4", aggregation="ps_cpu",
                                      ordered_sum_bytes=threshold)
        trainers[threshold] = helpers.build_trainer(config, make_model=wide_model)
        helpers.run_batches(trainers[threshold], batches[:1])  # trace, build the slots
    assert trainers[0].step.hooks.find(OrderedSumHook) is None
    kernel = trainers[2 ** 20].copies[0].trainable[0]
    # the wide kernel alone
    assert trainers[2 ** 20].step.hooks.find(OrderedSumHook).indices == [0]
    kernel_bytes = kernel.shape.num_elements() * 4
    peaks = {threshold: step_peak_bytes(trainer, batches[1])
             for threshold, trainer in trainers.items()}
    assert peaks[0] - peaks[2 ** 20] >= kernel_bytes, peaks
    # both are within the bound of the one-device run (tests/tolerance.py), so within twice it
    _, _, bound = helpers.train_reference_bounded(config, batches, make_model=wide_model)
    unordered, ordered = (helpers.copy_weights(t)[0] for t in trainers.values())
    tolerance.assert_within(ordered, unordered, [2 * t for t in bound.weights()])
