"""Host input pipelines (tf.data) over a dataset held in host memory.

Training reads an endless stream of global batches: every epoch is a fresh
seeded permutation of the example indices, batches are contiguous runs of that
stream (the last batch of an epoch may continue into the next), and the stream
depends only on the seed, so a run resumed at step s reads batch s next.

Examples are kept as stored (e.g. uint8 pixels) in one host tensor made once;
each batch is gathered from it, then `prepare`d into float32 model inputs and,
for training only, `augment`ed with random ops seeded by (seed, step). So batch
s is a pure function of (seed, s), augmentation included, and no dataset is
ever embedded in a graph as a constant.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import numpy as np
import tensorflow as tf

HOST = "/device:CPU:0"
AUGMENT_STREAM = 1  # salt that keeps augmentation seeds apart from permutation seeds

Prepare = Callable[[tf.Tensor], tf.Tensor]  # stored batch [B, ...] -> float32 inputs [B, ...]
Augment = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]  # (inputs [B, ...], seed [2]) -> inputs


def augment_seed(seed: int, step) -> tf.Tensor:
    """Seed [2] int64 of the augmentation of training step `step`: fold_in([seed, 1], step)."""
    return tf.random.experimental.stateless_fold_in(
        tf.constant([seed, AUGMENT_STREAM], tf.int64), tf.cast(step, tf.int64))


@dataclasses.dataclass(frozen=True)
class InMemoryDataset:
    """Train and eval splits as numpy arrays: x [N, ...] as stored, y int32 [N].

    `prepare` (None: identity) maps a batch of stored x to float32 inputs of
    the same shape, for training and eval alike; `augment` (None: none) then
    alters training batches only, as a function of the batch and a seed.
    """

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    eval_x: np.ndarray
    eval_y: np.ndarray
    num_classes: int
    prepare: Prepare | None = None
    augment: Augment | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])

    @functools.cached_property
    def _train_tensors(self) -> tuple[tf.Tensor, tf.Tensor]:
        with tf.device(HOST):
            return tf.constant(self.train_x), tf.constant(self.train_y)

    @functools.cached_property
    def _eval_tensors(self) -> tuple[tf.Tensor, tf.Tensor]:
        with tf.device(HOST):
            return tf.constant(self.eval_x), tf.constant(self.eval_y)

    def _inputs(self, stored: tf.Tensor) -> tf.Tensor:
        return stored if self.prepare is None else self.prepare(stored)

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
        """Global batches (x [B, ...] float32, y [B]) on the host, from step `start_step` on."""
        return self.batches_of(self.train_indices(global_batch, seed, start_step), seed,
                               start_step)

    def batches_of(self, indices: tf.data.Dataset, seed: int, start_step: int) -> tf.data.Dataset:
        """(x, y) of a stream of index batches whose first one is step `start_step`.

        Batch s holds the examples of its indices, prepared, then augmented with
        the seed `augment_seed(seed, s)`.
        """
        x, y = self._train_tensors

        def batch(step, indices):
            inputs = self._inputs(tf.gather(x, indices))
            if self.augment is not None:
                inputs = self.augment(inputs, augment_seed(seed, step))
            return inputs, tf.gather(y, indices)

        return tf.data.Dataset.zip(tf.data.Dataset.counter(start_step), indices).map(batch)

    def eval_batches(self, batch_size: int) -> tf.data.Dataset:
        """The eval split once, in order, prepared (never augmented); the last batch may be
        smaller."""
        x, y = self._eval_tensors
        return tf.data.Dataset.range(0, len(self.eval_y), batch_size).map(
            lambda start: (self._inputs(x[start:start + batch_size]), y[start:start + batch_size]))
