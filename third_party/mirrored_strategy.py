"""Baseline: `tf.distribute.MirroredStrategy` with a custom training loop.

Re-creates the TensorFlow guide "Custom training with tf.distribute.Strategy",
the modern TensorFlow answer to multi-device training on one machine: the
model and optimizer are created in `strategy.scope()` (every variable is a
MirroredVariable, one copy per device), the global batches are split by
`strategy.experimental_distribute_dataset`, and each replica runs

    loss_r = sum over its examples i of loss_i / global batch   (tf.nn.compute_average_loss)
    optimizer.apply_gradients(grads of loss_r)

(loss_i: the mean of example i's loss values, over its L tokens for a sequence: `per_example`)

inside `strategy.run`; the Keras optimizer all-reduces (sums) the replicas'
gradients through the strategy's cross-device ops, so every copy applies the
gradient of the mean loss over the global batch, and the reported loss is the
sum over replicas of loss_r.

For a fair comparison with mgloop, `train_loop` runs `num_steps` steps inside
one `tf.function` call with a `tf.range` loop, like mgloop's `train_loop`
(the guide calls one `tf.function` per step).

On logical CPU devices the strategy gets the device names explicitly and
`tf.distribute.ReductionToOneDevice` (sum on the host, copy back: what
MirroredStrategy used for CPU devices before collective ops became its
default). TensorFlow 2.21's default choice for these devices,
CollectiveAllReduce, fails inside a `tf.range` loop on CPU devices;
`HierarchicalCopyAllReduce` also runs and is selectable. On GPUs, `default`
leaves the choice to TensorFlow (NCCL all-reduce), as a user would.
"""

from __future__ import annotations

from typing import Callable

import keras
import tensorflow as tf

HOST = "/device:CPU:0"
CROSS_DEVICE_OPS = ("reduce_to_one", "hierarchical_copy", "default")


def per_example(losses: tf.Tensor) -> tf.Tensor:
    """One loss per example: the mean over every other axis of the loss's values, e.g. over
    the L tokens of a sequence ([B, L] -> [B]). `tf.nn.compute_average_loss` sums every
    element it is given and divides by the global batch, so values per token would give L
    times the mean over the global batch's tokens (and L times its gradient); the guide asks
    for this mean ("if labels are multi-dimensional, average the per_example_loss across
    the number of elements in each sample"). Every example has the same number of
    elements, so the result is the mean over every element of the global batch, as mgloop
    and the single-device loop take it."""
    losses = tf.convert_to_tensor(losses)
    if losses.shape.rank is not None and losses.shape.rank > 1:
        losses = tf.reduce_mean(losses, axis=list(range(1, losses.shape.rank)))
    return losses


def make_strategy(devices: list[str], cross_device_ops: str = "reduce_to_one",
                  host: str = HOST) -> tf.distribute.MirroredStrategy:
    if cross_device_ops == "reduce_to_one":
        ops = tf.distribute.ReductionToOneDevice(reduce_to_device=host)
    elif cross_device_ops == "hierarchical_copy":
        ops = tf.distribute.HierarchicalCopyAllReduce(num_packs=1)
    elif cross_device_ops == "default":
        ops = None  # TensorFlow's choice for these devices
    else:
        raise ValueError(f"cross_device_ops={cross_device_ops!r} is not one of "
                         f"{', '.join(CROSS_DEVICE_OPS)}")
    return tf.distribute.MirroredStrategy(devices=list(devices), cross_device_ops=ops)


class CustomLoop:
    """Model, optimizer and compiled multi-step loop under one MirroredStrategy."""

    def __init__(self, strategy: tf.distribute.MirroredStrategy,
                 model_fn: Callable[[], keras.Model], loss_fn,
                 optimizer_fn: Callable[[], keras.optimizers.Optimizer], global_batch: int,
                 jit_compile: bool = False):
        """`jit_compile`: each replica's forward and backward pass compiled by XLA
        (`tf.function(jit_compile=True)` inside `strategy.run`); the all-reduce and the
        update are not (they are the strategy's)."""
        self.strategy = strategy
        self._forward_backward = (tf.function(self._forward_backward, jit_compile=True)
                                  if jit_compile else self._forward_backward)
        self.loss_fn = loss_fn
        self.global_batch = global_batch
        with strategy.scope():
            self.model = model_fn()
            self.optimizer = optimizer_fn()
            self.optimizer.build(self.model.trainable_variables)

    def distribute(self, batches: tf.data.Dataset):
        """An iterator of per-replica shards of the global batches of `batches`."""
        return iter(self.strategy.experimental_distribute_dataset(batches))

    def _replica_step(self, x, y):
        loss, grads = self._forward_backward(x, y)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return loss

    def _forward_backward(self, x, y):
        with tf.GradientTape() as tape:
            predictions = self.model(x, training=True)
            loss = tf.nn.compute_average_loss(per_example(self.loss_fn(y, predictions)),
                                              global_batch_size=self.global_batch)
            if self.model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(self.model.losses))
        return loss, tape.gradient(loss, self.model.trainable_variables)

    @tf.function
    def train_loop(self, iterator, num_steps):
        """`num_steps` steps in one call; returns the sum of the steps' mean losses."""
        loss_sum = tf.constant(0.0)
        for _ in tf.range(num_steps):
            x, y = next(iterator)
            per_replica = self.strategy.run(self._replica_step, args=(x, y))
            loss_sum += self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
        return loss_sum
