"""A softmax or sigmoid output layer gets the cross-entropy on probabilities, never a
second activation inside the loss (issue 12, item 2).

Equivalence tolerance. mgloop's towers run the same ops on the same rows as the
single-device reference; they differ only in the order of float32 sums. A
result that sums at most n terms, computed in two orders, differs by at most
2 n u sum|terms| (u = 2^-24, first order; Higham's bound for recursive
summation). Every value here sums at most n = B + d terms (B = 16 examples of
the batch mean, d = 192 inputs of the widest dot product), so per element and
step the gradients differ by at most 2 n u A, where A = mean over the batch of
|per-example gradient| (computed at the reference's weights, every step), and
plain SGD turns that into lr * 2 n u A per step, summed over the steps, plus
the rounding of the weights themselves (u |w| per step and side). Later steps
also see the weights' earlier difference through the gradient (a relative
change of order lr * curvature per step, small for three steps of lr 0.1); a
factor 2 allows for it.
The losses: the mean over B of per-example losses, same bound with A = mean |loss|.
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from mgloop.runs import experiment
from mgloop.training import heads, losses, optim
from mgloop.errors import ConfigError
from tests import helpers
from third_party import single_device

U = 2.0 ** -24
N_TERMS = helpers.GLOBAL_BATCH + int(np.prod(helpers.DATASET.input_shape))
STEPS = 3
SHAPE = helpers.DATASET.input_shape


def head(units, activation):
    """An MLP whose last Dense applies `activation`; its kernel's spread (stddev 1) makes
    the probabilities far from uniform, so a second softmax/sigmoid would show."""
    return lambda: keras.Sequential([
        keras.Input(SHAPE), keras.layers.Flatten(), keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(units, activation=activation,
                           kernel_initializer=keras.initializers.RandomNormal(stddev=1.0))])


def reference_with_bound(config, make_model, keras_loss, steps_batches):
    """Single-device SGD with Keras's loss; per step, mean |per-example gradient|."""
    experiment.seed_everything(config.seed, config.deterministic)
    with tf.device("/device:CPU:0"):
        model = make_model()
        step = single_device.make_train_step(
            model, keras_loss, optim.make_optimizer(config.optim, config.train_steps))

        @tf.function
        def example_grads(x, y):
            with tf.GradientTape() as tape:
                loss = keras_loss(y[None], model(x[None], training=True))
            return tape.gradient(loss, model.trainable_variables), loss

        sums = [np.zeros(v.shape) for v in model.trainable_variables]
        losses_seen = []
        for x, y in steps_batches:
            per_example = [example_grads(tf.constant(xi), tf.constant(yi)) for xi, yi in zip(x, y)]
            for total, grads in zip(sums, zip(*[g for g, _ in per_example])):
                total += config.learning_rate * np.mean([np.abs(g) for g in grads], axis=0)
            losses_seen.append(np.mean([abs(float(l)) for _, l in per_example]))
            step(tf.constant(x), tf.constant(y))
    bounds = [2 * (2 * N_TERMS * U * total + 2 * STEPS * U * np.abs(v.numpy()))
              for total, v in zip(sums, model.trainable_variables)]
    return [v.numpy() for v in model.trainable_variables], bounds, losses_seen


@pytest.mark.parametrize("units,activation,keras_loss,labels,aggregation", [
    (10, "softmax", keras.losses.SparseCategoricalCrossentropy(), lambda y: y, "ring"),
    (10, "softmax", keras.losses.SparseCategoricalCrossentropy(), lambda y: y, "colocate"),
    (1, "sigmoid", keras.losses.BinaryCrossentropy(), lambda y: y % 2, "ring")],
    ids=["softmax", "softmax-colocate", "sigmoid"])
def test_probability_head_trains_as_keras_from_probabilities(units, activation, keras_loss,
                                                             labels, aggregation, logdir):
    make_model = head(units, activation)
    steps_batches = [(x, labels(y)) for x, y in helpers.batches(STEPS)]
    config = helpers.small_config(logdir, devices="cpu:4", aggregation=aggregation,
                                  optimizer="sgd")
    trainer = helpers.build_trainer(config, make_model)
    assert trainer.loss_fn.outputs == activation  # the default loss, matched to the head

    x0, y0 = steps_batches[0]
    keras_initial = float(keras_loss(y0, trainer.model(x0, training=True)))
    chance = math.log(units) if units > 1 else math.log(2)  # where a doubled activation sits
    assert abs(keras_initial - chance) > 0.5  # the premise: the two readings differ
    first_loss = helpers.run_batches(trainer, steps_batches[:1])
    np.testing.assert_allclose(first_loss, keras_initial, rtol=4 * N_TERMS * U)
    helpers.run_batches(trainer, steps_batches[1:])

    expected, bounds, _ = reference_with_bound(config, make_model, keras_loss, steps_batches)
    for copy in helpers.copy_weights(trainer):
        for actual, want, bound in zip(copy, expected, bounds):
            np.testing.assert_array_less(np.abs(actual - want), bound + 1e-30)
    start = helpers.build_trainer(config, make_model)  # the weights moved: not a vacuous match
    assert max(np.max(np.abs(a - b)) for a, b in zip(helpers.copy_weights(start)[0], expected)
               ) > 100 * max(np.max(b) for b in bounds)


def subclassed_softmax():
    class Model(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(10)

        def call(self, x):
            return tf.nn.softmax(self.dense(keras.ops.reshape(x, (-1, int(np.prod(SHAPE))))))
    return Model()


def functional_ops_sigmoid():
    x = keras.Input(SHAPE)
    return keras.Model(x, keras.ops.sigmoid(keras.layers.Dense(1)(keras.layers.Flatten()(x))))


def nested_softmax_layer():
    inner = keras.Sequential([keras.Input(SHAPE), keras.layers.Flatten(), keras.layers.Dense(10),
                              keras.layers.Softmax()])
    return keras.Sequential([keras.Input(SHAPE), inner])


def mobilenet(classifier_activation):
    return lambda: keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=10,
        classifier_activation=classifier_activation)


@pytest.mark.parametrize("make_model,expected", [
    (helpers.model_fn("mlp"), heads.LOGITS),
    (head(10, "softmax"), heads.SOFTMAX),
    (head(1, "sigmoid"), heads.SIGMOID),
    (head(10, "log_softmax"), heads.LOGITS),  # log-probabilities are logits
    (lambda: keras.Sequential([keras.Input(SHAPE), keras.layers.Flatten(), keras.layers.Dense(3),
                               keras.layers.Activation("sigmoid"),
                               keras.layers.Reshape((3, 1))]), heads.SIGMOID),
    (nested_softmax_layer, heads.SOFTMAX),
    (functional_ops_sigmoid, heads.SIGMOID),
    (subclassed_softmax, heads.SOFTMAX),
    (mobilenet("softmax"), heads.SOFTMAX),  # as Keras ships it (the case)
    (mobilenet(None), heads.LOGITS),
], ids=["mlp", "dense-softmax", "dense-sigmoid", "log-softmax", "activation-reshape",
        "nested-softmax-layer", "ops-sigmoid", "subclassed", "mobilenetv2", "mobilenetv2-logits"])
def test_output_activation_of_every_kind_of_model(make_model, expected):
    model = make_model()
    shape = tuple(model.inputs[0].shape[1:]) if model.built else SHAPE
    if not model.built:
        model(tf.zeros((1, *shape)))
    assert heads.output_activation(model, shape) == expected
    resolved = losses.for_model(losses.cross_entropy, model, shape)
    assert getattr(resolved, "outputs", None) == expected
    assert losses.for_model(keras.losses.MeanSquaredError(), model, shape).__class__ is (
        keras.losses.MeanSquaredError)  # a loss the user gave is used as given


def test_softmax_over_one_unit_is_refused():
    with pytest.raises(ConfigError, match="softmax over one unit"):
        losses.for_model(losses.cross_entropy, head(1, "softmax")(), SHAPE)


@pytest.mark.parametrize("activation,labels", [
    (tf.nn.softmax, [1, 0]), (tf.nn.sigmoid, [[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])])
def test_default_loss_reads_an_activation_it_was_not_told_of(activation, labels):
    """The fallback for a model output_activation cannot trace: the step's trace looks at
    the op that made the outputs, as Keras's from_logits=False cross-entropy does."""
    keras_loss = {tf.nn.softmax: keras.losses.sparse_categorical_crossentropy,
                  tf.nn.sigmoid: keras.losses.binary_crossentropy}[activation]
    z = tf.constant([[2.0, -1.0, 0.5], [0.3, 3.0, -2.0]])

    @tf.function
    def both(z):
        probabilities = activation(z)
        return (losses.cross_entropy(tf.constant(labels), probabilities),
                keras_loss(tf.constant(labels), probabilities))
    ours, theirs = both(z)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=8 * U)
