"""Baseline: a single-device `tf.function` training step on the whole global batch.

Re-creates the plain TensorFlow 2 custom training loop of the Keras guide
"Writing a training loop from scratch": one `tf.GradientTape` over the global
batch, the mean loss, `optimizer.apply_gradients`. It knows nothing of towers,
which is why mgloop's equivalence tests use it as the reference: N towers must
compute what this computes on the same global batch.

`make_train_loop` runs `num_steps` such steps inside one `tf.function` call
(a `tf.range` loop over an iterator, as mgloop's `Trainer.train_loop` does),
so the benchmark compares the two with the same Python cost per loop.
"""

from __future__ import annotations

import keras
import tensorflow as tf


def _forward_backward(model: keras.Model, loss_fn, x, y):
    with tf.GradientTape() as tape:
        predictions = model(x, training=True)
        loss = tf.reduce_mean(loss_fn(y, predictions))
        if model.losses:
            loss += tf.add_n(model.losses)
    return loss, tape.gradient(loss, model.trainable_variables)


def _step(model: keras.Model, loss_fn, optimizer: keras.optimizers.Optimizer, x, y,
          forward_backward=_forward_backward):
    loss, grads = forward_backward(model, loss_fn, x, y)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss


def make_train_step(model: keras.Model, loss_fn, optimizer: keras.optimizers.Optimizer):
    """Returns step(x, y) -> mean loss, updating `model` in place."""

    @tf.function
    def step(x, y):
        return _step(model, loss_fn, optimizer, x, y)

    return step


def make_mixed_precision_train_step(model: keras.Model, loss_fn,
                                    optimizer: keras.optimizers.Optimizer):
    """Returns step(x, y) -> mean loss for a model built under a mixed-precision policy.

    Re-creates the custom training loop of the Keras mixed-precision guide: the
    logits are cast to float32 before the loss; with a
    `keras.optimizers.LossScaleOptimizer`, the loss is scaled by
    `optimizer.scale_loss` before differentiating and `apply` unscales the
    gradients, skipping the update (and halving the scale) when one is not finite.
    """
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            predictions = tf.cast(model(x, training=True), tf.float32)
            loss = tf.reduce_mean(loss_fn(y, predictions))
            if model.losses:
                loss += tf.add_n([tf.cast(l, tf.float32) for l in model.losses])
            objective = optimizer.scale_loss(loss) if scaled else loss
        grads = tape.gradient(objective, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    return step


def make_train_loop(model: keras.Model, loss_fn, optimizer: keras.optimizers.Optimizer,
                    jit_compile: bool = False):
    """Returns loop(iterator, num_steps) -> sum of the step losses: `num_steps` steps, one call.
    `jit_compile`: the forward and backward pass compiled by XLA (the update is not), as
    the Keras/TensorFlow guides suggest for speed (`tf.function(jit_compile=True)`)."""
    forward_backward = (tf.function(_forward_backward, jit_compile=True) if jit_compile
                        else _forward_backward)

    @tf.function
    def loop(iterator, num_steps):
        loss_sum = tf.constant(0.0)
        for _ in tf.range(num_steps):
            x, y = next(iterator)
            loss_sum += _step(model, loss_fn, optimizer, x, y, forward_backward)
        return loss_sum

    return loop
