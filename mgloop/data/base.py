"""Host input pipelines (tf.data) over a dataset held in host memory.

Training reads an endless stream of global batches: every epoch is a fresh
seeded permutation of the example indices, batches are contiguous runs of that
stream (the last batch of an epoch may continue into the next), and the stream
depends only on the seed, so a run resumed at step s reads batch s next.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class InMemoryDataset:
    """Train and eval splits as numpy arrays: x float32 [N, ...], y int32 [N]."""

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    eval_x: np.ndarray
    eval_y: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])

    def train_indices(self, global_batch: int, seed: int, start_step: int = 0) -> tf.data.Dataset:
        """Batches of example indices [global_batch] int32, from step `start_step` on.

        Epoch e is the permutation argsort(stateless_uniform(seed=[seed, e])): a
        pure function of (seed, e), independent of TensorFlow's global seed.
        """
        n = len(self.train_y)

        def epoch_permutation(epoch):
            keys = tf.random.stateless_uniform([n], seed=tf.stack([tf.constant(seed, tf.int64),
                                                                   epoch]))
            return tf.data.Dataset.from_tensor_slices(tf.argsort(keys, stable=True))

        stream = tf.data.Dataset.counter().flat_map(epoch_permutation)
        return stream.batch(global_batch, drop_remainder=True).skip(start_step)

    def train_batches(self, global_batch: int, seed: int, start_step: int = 0) -> tf.data.Dataset:
        """Global batches (x [B, ...], y [B]) on the host, from step `start_step` on."""
        x, y = tf.constant(self.train_x), tf.constant(self.train_y)
        return self.train_indices(global_batch, seed, start_step).map(
            lambda idx: (tf.gather(x, idx), tf.gather(y, idx)))

    def eval_batches(self, batch_size: int) -> tf.data.Dataset:
        """The eval split once, in order; the last batch may be smaller."""
        return tf.data.Dataset.from_tensor_slices((self.eval_x, self.eval_y)).batch(batch_size)
