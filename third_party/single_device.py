"""Baseline: a single-device `tf.function` training step on the whole global batch.

Re-creates the plain TensorFlow 2 custom training loop of the Keras guide
"Writing a training loop from scratch": one `tf.GradientTape` over the global
batch, the mean loss, `optimizer.apply_gradients`. It knows nothing of towers,
which is why mgloop's equivalence tests use it as the reference: N towers must
compute what this computes on the same global batch.
"""

from __future__ import annotations

import keras
import tensorflow as tf


def make_train_step(model: keras.Model, loss_fn, optimizer: keras.optimizers.Optimizer):
    """Returns step(x, y) -> mean loss, updating `model` in place."""

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            predictions = model(x, training=True)
            loss = tf.reduce_mean(loss_fn(y, predictions))
            if model.losses:
                loss += tf.add_n(model.losses)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step
