"""Stateless image augmentation on a batch: random padded crop and horizontal flip.

Every random draw comes from a seed [2] passed in (no global or op state), so
the same (images, seed) always gives the same batch, on any machine.
"""

from __future__ import annotations

import tensorflow as tf


def crop_and_flip_params(seed: tf.Tensor, batch: tf.Tensor, pad: int):
    """Per-example crop offsets [B, 2] (row, col) in 0..2*pad and flips [B] in {0, 1}."""
    offset_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
    offsets = tf.random.stateless_uniform([batch, 2], offset_seed, minval=0, maxval=2 * pad + 1,
                                          dtype=tf.int32)
    flips = tf.random.stateless_uniform([batch], flip_seed, minval=0, maxval=2, dtype=tf.int32)
    return offsets, flips


def random_crop_and_flip(images: tf.Tensor, seed: tf.Tensor, pad: int = 4) -> tf.Tensor:
    """images [B, H, W, C] -> [B, H, W, C]: each example is zero-padded by `pad` pixels on
    every side, cropped back to H x W at a random offset (row r, col c in 0..2*pad), and
    mirrored left-right with probability 1/2:

        out[b, i, j] = padded[b, r_b + i, c_b + (W - 1 - j if flip_b else j)]
    """
    height, width = images.shape[1], images.shape[2]
    offsets, flips = crop_and_flip_params(seed, tf.shape(images)[0], pad)
    padded = tf.pad(images, [[0, 0], [pad, pad], [pad, pad], [0, 0]])
    rows = offsets[:, :1] + tf.range(height)[None, :]  # [B, H]
    cols = offsets[:, 1:] + tf.range(width)[None, :]  # [B, W]
    cols = tf.where(flips[:, None] == 1, tf.reverse(cols, axis=[1]), cols)
    cropped = tf.gather(padded, rows, axis=1, batch_dims=1)
    return tf.gather(cropped, cols, axis=2, batch_dims=1)
