"""The step (mgloop/step/training_step.py): hooks plug in without touching it; nested features and labels;
metric objects merged across towers; honest traffic and exchange timing."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from mgloop import aggregation
from mgloop.cluster import devices
from mgloop.runs import assemble, experiment
from mgloop.training import losses, optim
from mgloop.step import per_tower
from mgloop.step.hooks import Hook
from tests import helpers
from tests import tolerance

STEPS = 3


def run_steps(trainer, steps=STEPS):
    return helpers.run_batches(trainer, helpers.batches(steps))


def build(config, hooks=(), metrics=None):
    """mgloop's trainer for `config` with a user's `hooks` and `metrics` (assemble.build)."""
    config = config.validated()
    device_set = devices.setup(devices.parse(config.devices, config.towers_per_device))
    experiment.seed_everything(config.seed, config.deterministic)  # as build_trainer does
    return assemble.build(helpers.model_fn(config.model), experiment.default_loss(),
                          aggregation.get(config.aggregation)(device_set),
                          functools.partial(optim.make_optimizer, config.optim,
                                            config.train_steps),
                          helpers.DATASET.input_shape, config, metrics=metrics, hooks=hooks)


class CountingObserver(Hook):
    """Records how many towers' losses and gradients the step hands `observe`."""

    def __init__(self):
        self.seen = []

    def observe(self, losses, grads):
        self.seen.append((len(losses), len(grads), len(grads[0])))


class Veto(Hook):
    """Lets no copy apply its update."""

    def may_apply(self, grads):
        return lambda copy, update: None


class ScaleByFour(Hook):
    """Differentiates 4 * loss and divides the gradients by 4 (exact in binary floats)."""

    def scale_loss(self, t, loss):
        return loss * 4.0

    def unscale(self, t, grads):
        return [g / 4.0 for g in grads]


def test_a_plugged_in_hook_observes_every_tower(logdir):
    observer = CountingObserver()  # plugged in; the step itself is not edited
    trainer = build(helpers.small_config(logdir, devices="cpu:4", aggregation="ring"),
                    hooks=[observer])
    run_steps(trainer)
    variables = len(trainer.copies[0].trainable)
    assert observer.seen == [(4, 4, variables)]  # traced once: 4 towers' losses and grads


def test_a_hook_may_veto_the_update(logdir):
    trainer = build(helpers.small_config(logdir, devices="cpu:2", aggregation="ps_cpu"),
                    hooks=[Veto()])
    before = helpers.copy_weights(trainer)
    run_steps(trainer)
    for a, b in zip(helpers.copy_weights(trainer)[0], before[0]):
        np.testing.assert_array_equal(a, b)
    assert int(trainer.copies[0].optimizer.iterations.numpy()) == 0
    assert int(trainer.global_step.numpy()) == STEPS  # the steps consumed their batches


def test_loss_and_gradient_hooks_compose_exactly(logdir):
    """A hook scaling the loss by 4 and the gradients by 1/4 trains bit-identically."""
    config = helpers.small_config(logdir, devices="cpu:2", aggregation="ring")
    plain = build(config)
    plain_loss = run_steps(plain)
    scaled = build(config, hooks=[ScaleByFour()])
    assert run_steps(scaled) == plain_loss
    for a, b in zip(helpers.copy_weights(scaled)[0], helpers.copy_weights(plain)[0]):
        np.testing.assert_array_equal(a, b)


def dropout_batch_norm_model(input_shape, num_classes):
    """Per-tower random draws (dropout) and per-tower state (batch norm's statistics)."""
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(16), keras.layers.BatchNormalization(),
                             keras.layers.ReLU(), keras.layers.Dropout(0.3),
                             keras.layers.Dense(num_classes)])


def test_the_pass_traced_once_equals_one_trace_per_tower_bit_for_bit(logdir):
    """With no hook acting inside a tower's pass, the step traces the pass once and calls it
    on each of the 4 towers' devices (per_tower.SharedPass); forced to trace it per tower
    (per_tower.group_pass), the same steps give the same bits: weights, batch norm's moving
    statistics, the dropout streams' states and the losses."""
    config = helpers.small_config(logdir, devices="cpu:4", aggregation="ring")
    make = functools.partial(dropout_batch_norm_model, helpers.DATASET.input_shape,
                             helpers.DATASET.num_classes)
    shared = helpers.build_trainer(config, make)
    per_tower_traces = helpers.build_trainer(config, make)
    assert isinstance(shared.step.group_pass, per_tower.SharedPass)
    per_tower_traces.step.group_pass = per_tower.group_pass
    assert run_steps(shared) == run_steps(per_tower_traces)
    assert shared.step.group_pass._body.experimental_get_tracing_count() == 1  # not 4
    for a, b in zip(shared.model.get_weights(), per_tower_traces.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(shared.model.non_trainable_variables,
                    per_tower_traces.model.non_trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # moving statistics, seeds


def test_a_hook_acting_inside_a_towers_pass_gets_one_trace_per_tower(logdir):
    trainer = build(helpers.small_config(logdir, devices="cpu:2", aggregation="ring"),
                    hooks=[ScaleByFour()])
    assert trainer.step.group_pass is per_tower.group_pass  # its scale_loss(t, ...)


# Nested features and labels: a two-input model whose math is the flat mlp's on concat(a, b).
WIDTH_A, WIDTH_B, HIDDEN, CLASSES = 4, 2, 8, 3


def nested_model():
    a, b = keras.Input((WIDTH_A,), name="a"), keras.Input((WIDTH_B,), name="b")
    hidden = keras.layers.Dense(HIDDEN, activation="relu")(keras.layers.Concatenate()([a, b]))
    return keras.Model({"a": a, "b": b}, keras.layers.Dense(CLASSES)(hidden))


def weighted_loss(y, outputs):
    """Labels (class, weight): weight * cross-entropy per example."""
    labels, weights = y
    return tf.cast(weights, tf.float32) * losses.cross_entropy(labels, outputs)


def nested_batches(steps: int):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(steps, helpers.GLOBAL_BATCH, WIDTH_A + WIDTH_B)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(steps, helpers.GLOBAL_BATCH)).astype(np.int32)
    return x, y


@pytest.mark.parametrize("towers", [2, 4])
def test_nested_features_and_labels_equal_single_device(towers, logdir):
    """Features {"a", "b"} and labels (class, weight 1) split per leaf over the towers train
    as the flat model on concat(a, b) with the plain loss does on one device, within the
    one-device run's float32 bound (tests/tolerance.py)."""
    config = helpers.small_config(logdir, devices=f"cpu:{towers}", aggregation="ring")
    settings = config.validated()
    device_set = devices.setup(devices.parse(settings.devices))
    trainer = experiment.build_trainer(settings, device_set, nested_model, weighted_loss, None)
    initial = [v.numpy() for v in trainer.copies[0].trainable]
    x, y = nested_batches(STEPS)
    features = {"a": x[..., :WIDTH_A], "b": x[..., WIDTH_A:]}
    labels = (y, np.ones(y.shape, np.float32))
    result = trainer.train_loop(iter(tf.data.Dataset.from_tensor_slices((features, labels))),
                                STEPS)
    assert result.steps == STEPS

    def flat_model():
        model = keras.Sequential([keras.Input((WIDTH_A + WIDTH_B,)),
                                  keras.layers.Dense(HIDDEN, activation="relu"),
                                  keras.layers.Dense(CLASSES)])
        model.set_weights(initial)
        return model
    expected = helpers.train_reference_bounded(config, list(zip(x, y)), flat_model)
    tolerance.assert_matches_reference(helpers.copy_weights(trainer)[0], result.loss_sum,
                                       expected)
    batches = tf.data.Dataset.from_tensor_slices((features, labels)).unbatch().batch(7)
    assert np.isfinite(trainer.evaluate(batches)["loss"])  # uneven nested shards
    predicted = trainer.predict(tf.data.Dataset.from_tensor_slices(features).unbatch().batch(5))
    assert predicted.shape == (STEPS * helpers.GLOBAL_BATCH, CLASSES)


class RecallOfClassZero:
    """A user's metric: of the examples labelled 0, the share predicted 0."""

    name, size = "recall_0", 2

    def counts(self, y, outputs):
        truth = tf.equal(tf.cast(tf.reshape(y, [-1]), tf.int32), 0)
        hit = tf.logical_and(truth, tf.equal(tf.argmax(outputs, -1, output_type=tf.int32), 0))
        return tf.stack([tf.reduce_sum(tf.cast(hit, tf.float32)),
                         tf.reduce_sum(tf.cast(truth, tf.float32))])

    def result(self, sums):
        return float(sums[0] / sums[1]) if sums[1] else None


def test_a_metric_object_merges_across_towers_as_one_device(logdir):
    """On 4 towers, the metric's state of one step (at the initial weights) and of an
    evaluation on uneven shards equal the one-device value over the whole batch."""
    trainer = build(helpers.small_config(logdir, devices="cpu:4", aggregation="ring"),
                    metrics=[RecallOfClassZero()])
    (x, y), = helpers.batches(1)
    predicted = np.argmax(trainer.model(x).numpy(), -1)  # one device, initial weights
    expected = [np.sum((y == 0) & (predicted == 0)), np.sum(y == 0)]
    result = trainer.train_loop(iter(tf.data.Dataset.from_tensor_slices((x[None], y[None]))), 1)
    np.testing.assert_array_equal(result.metric_sums["recall_0"], expected)
    eval_x, eval_y = helpers.DATASET.eval_x[:23], helpers.DATASET.eval_y[:23]
    predicted = np.argmax(trainer.model(eval_x).numpy(), -1)
    recall = np.sum((eval_y == 0) & (predicted == 0)) / np.sum(eval_y == 0)
    metrics = trainer.evaluate(tf.data.Dataset.from_tensor_slices((eval_x, eval_y)).batch(10))
    assert metrics["recall_0"] == pytest.approx(recall, abs=0)
    assert "accuracy" not in metrics  # the metrics given replace the default


def large_gradient_config(logdir, **overrides):
    """ps_cpu on 4 logical CPUs, every kernel factored and every other variable ordered."""
    return helpers.small_config(logdir, devices="cpu:4", aggregation="ps_cpu",
                                sufficient_factor_bytes=1, ordered_sum_bytes=1, **overrides)


def test_traffic_is_the_ordinary_steps_with_diagnostics(logdir):
    """The sampled step (no factoring: its statistics need every tower's gradient) moves
    other bytes; the recorded traffic stays the ordinary step's."""
    plain = helpers.build_trainer(large_gradient_config(logdir))
    run_steps(plain)
    sampled = helpers.build_trainer(large_gradient_config(logdir, diagnostics=True,
                                                          summary_every=STEPS))
    result = sampled.train_loop(
        iter(tf.data.Dataset.from_tensor_slices(tuple(np.stack(v) for v in
                                                      zip(*helpers.batches(STEPS))))),
        STEPS, sample_stats=True)
    assert result.stats  # the sampled step ran
    assert plain.large_gradients["factored"]  # the ordinary step factors
    assert sampled.aggregation.traffic.as_dict() == plain.aggregation.traffic.as_dict()


def test_exchange_timing_runs_the_large_gradient_sums(logdir):
    """exchange_seconds times the step's own exchange path: the hooks' after_tower (large
    gradients sent home and summed there) for every tower, then the exchange; the traffic
    and the step's record of what it factored are left as the step's."""
    trainer = helpers.build_trainer(large_gradient_config(logdir))
    run_steps(trainer)
    factored = dict(trainer.large_gradients)
    assert factored["factored"] and factored["ordered"]
    traffic = trainer.aggregation.traffic.as_dict()
    calls = []
    original = trainer.step.hooks.after_tower

    def counting(t, out):
        calls.append((t, sorted(out.factors)))
        return original(t, out)
    trainer.step.hooks.after_tower = counting
    assert trainer.time_exchange(repeats=1, per_call=1) > 0
    assert [t for t, _ in calls] == [0, 1, 2, 3]  # traced once, every tower
    assert all(kernels == factored["factored"] for _, kernels in calls)  # with their factors
    assert trainer.large_gradients == factored
    assert trainer.aggregation.traffic.as_dict() == traffic
