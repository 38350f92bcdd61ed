"""The Python API: any model function, any loss, non-trainable state, one compiled loop."""

import keras
import numpy as np
import tensorflow as tf

import mgloop
from mgloop import data
from mgloop.runs import experiment
from tests import helpers
from tests import tolerance


class Residual(keras.Model):
    """A subclassed (not functional) model, built lazily by mgloop."""

    def __init__(self):
        super().__init__()
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(32, activation="tanh")
        self.out = keras.layers.Dense(10)

    def call(self, x):
        h = self.flatten(x)
        return self.out(h + 0.0 * tf.reduce_sum(h) + self.hidden(h)[:, :1])


def per_example_loss(y, logits):
    """A plain function returning one loss per example (mgloop takes their mean)."""
    return tf.nn.sparse_softmax_cross_entropy_with_logits(tf.cast(y, tf.int32), logits)


def test_custom_model_and_loss_equal_single_device(logdir):
    config = helpers.small_config(logdir, devices="cpu:4", aggregation="ring")
    trainer = helpers.build_trainer(config, Residual, per_example_loss)
    steps = helpers.batches(4)
    helpers.run_batches(trainer, steps)

    experiment.seed_everything(config.seed, True)
    reference = Residual()
    reference(tf.zeros((1, *helpers.DATASET.input_shape)))
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    bound = tolerance.StepBound()  # tests/tolerance.py: the float32 bound of another order
    for x, y in steps:
        x, y = tf.constant(x), tf.constant(y)
        bound.before(reference, optimizer, per_example_loss, x, y)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(per_example_loss(y, reference(x)))
        grads = tape.gradient(loss, reference.trainable_variables)
        optimizer.apply_gradients(zip(grads, reference.trainable_variables))
        bound.after()
    for copy in trainer.copies:
        tolerance.assert_within([v.numpy() for v in copy.trainable],
                                [v.numpy() for v in reference.trainable_variables],
                                bound.weights())


def test_run_accepts_model_and_loss_functions(logdir):
    config = helpers.small_config(logdir, devices="cpu:2", train_steps=30)
    summary = mgloop.run(config, model_fn=Residual, loss=per_example_loss)
    assert summary["final_step"] == 30
    assert summary["eval_accuracy"] is None  # a plain loss function defines no accuracy
    # It learned: the eval loss is below the same model's at its initial weights (the
    # seed makes them: mgloop seeds, then calls model_fn).
    experiment.seed_everything(config.seed, True)
    initial = Residual()
    dataset = data.load(config.dataset, config.seed, None)
    eval_x = dataset.prepare(dataset.eval_x) if dataset.prepare else dataset.eval_x
    initial_loss = float(tf.reduce_mean(per_example_loss(dataset.eval_y, initial(eval_x))))
    assert summary["eval_loss"] < initial_loss


def batch_norm_model():
    return keras.Sequential([keras.Input(helpers.DATASET.input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(16), keras.layers.BatchNormalization(),
                             keras.layers.Dense(10)])


def test_moving_statistics_are_averaged_and_replicas_stay_identical(logdir):
    """Per-tower batch norm: the new moving mean is the mean over towers of each tower's
    update, m' = momentum * m + (1 - momentum) * mean_t(shard mean_t), identical on every
    replica; with equal shards that is the single-device moving mean of the same weights."""
    config = helpers.small_config(logdir, devices="cpu:4", aggregation="reduce_broadcast",
                                  learning_rate=1e-9)
    trainer = helpers.build_trainer(config, batch_norm_model)
    (x, y), = batch = helpers.batches(1)
    hidden = trainer.model.layers[1](trainer.model.layers[0](x)).numpy()  # Dense output
    helpers.run_batches(trainer, batch)
    bn = trainer.model.layers[2]
    expected_mean = (1 - bn.momentum) * hidden.mean(axis=0)  # moving mean starts at 0
    # Bound: the towers' h and this h differ by 2 gamma(K + 1) (|x| |W| + |b|) (a dot product
    # of K = 192 terms and the bias), their batch means (16 values, any order) by
    # 2 gamma(16) mean|h|; then (1 - momentum) and the moving-average update: 4 u |m'|.
    kernel, bias = (v.numpy() for v in trainer.model.layers[1].weights)
    flat = np.abs(x.reshape(len(x), -1))
    magnitude = (flat @ np.abs(kernel) + np.abs(bias)).mean(axis=0)
    bound = ((1 - bn.momentum) * (2 * tolerance.gamma(kernel.shape[0] + 1) * magnitude
                                  + 2 * tolerance.gamma(len(x)) * np.abs(hidden).mean(axis=0))
             + 4 * tolerance.U * np.abs(expected_mean))
    tolerance.assert_within([bn.moving_mean.numpy()], [expected_mean], [bound])
    for copy in trainer.copies[1:]:
        for a, b in zip(copy.non_trainable, trainer.copies[0].non_trainable):
            np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_loop_is_traced_once_for_every_loop_length(logdir):
    trainer = helpers.build_trainer(helpers.small_config(logdir, devices="cpu:2"))
    result = helpers.fit(trainer, helpers.DATASET.train_batches(16, 3), 17, 16, 5, summary_every=4)
    assert result.final_step == 17 and int(trainer.global_step.numpy()) == 17
    assert trainer.loop.compiled_loop.experimental_get_tracing_count() == 1
