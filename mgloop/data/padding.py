"""Short batches trained exactly: padded to the global batch, weighted so that the mean is
over the real examples (`--drop_remainder=false` on a user's data).

A pass over a user's data of N examples, cut into global batches of B, ends in a
batch of r = N mod B < B examples; r need not divide by the towers. With
`--drop_remainder=false` that batch is padded to B by repeating its own examples
(copies of real examples: every padded loss stays finite) and carries a mask m
(1 real, 0 padding). A step of K = --accumulation_steps global batches holds
S = K*B examples, n = sum_i m_i of them real; every example gets the weight

    w_i = m_i * S / n,

and the labels travel as `Weighted(labels, weights)`. A tower's loss is then the
mean over its S/(K T) examples of w_i * l_i (per_tower.mean_loss), so the step's
mean over towers (and micro-batches) is

    (1/S) sum_i w_i l_i = (1/n) sum_{i real} l_i,

the mean loss over the real examples, i.e. the one-device step on those n
examples; for a full step w_i = 1. Per-token losses ([B, L]) are weighted per
example, which gives the mean over the real examples' tokens. Metrics count the
real examples only (`real_examples`). Padded copies do change batch statistics,
so a model with batch normalization is refused with padding (`check_model`).
"""

from __future__ import annotations

import collections

import keras
import tensorflow as tf

from mgloop.errors import ConfigError

# labels of a step that holds padding: y as given, and weights float32 [S] (see above)
Weighted = collections.namedtuple("Weighted", ["labels", "weights"])


def pad_batch(x, y, batch: int):
    """(x, y) of n <= batch examples -> (x, y, mask) of `batch`, the padding copies of
    examples 0, 1, .. of the batch itself (index i mod n); mask float32 [batch]."""
    n = tf.shape(tf.nest.flatten(y)[0])[0]
    index = tf.range(batch) % n
    x, y = tf.nest.map_structure(lambda leaf: tf.gather(leaf, index), (x, y))
    mask = tf.cast(tf.range(batch) < n, tf.float32)
    return x, y, mask


def weigh(x, y, mask):
    """(x, y, mask [S]) of a step -> (x, Weighted(y, w)), w_i = m_i * S / sum(m)."""
    size = tf.cast(tf.shape(mask)[0], tf.float32)
    return x, Weighted(y, mask * (size / tf.reduce_sum(mask)))


def weighted_mean(losses: tf.Tensor, weights: tf.Tensor) -> tf.Tensor:
    """mean_i(w_i * l_i) over a shard; `losses` [b] or [b, ...] (per token: the example's
    weight on each of its tokens). A loss already reduced to one value is refused."""
    losses = tf.convert_to_tensor(losses)
    if losses.shape.rank == 0:
        raise ConfigError("--drop_remainder=false pads short batches and weighs each example, "
                          "but the loss returns one value per batch; give a loss with one "
                          "value per example (e.g. reduction=None) or use --drop_remainder=true")
    weights = tf.reshape(tf.cast(weights, losses.dtype), [-1] + [1] * (losses.shape.rank - 1))
    return tf.reduce_mean(losses * weights)


def real_examples(y, outputs):
    """(labels, outputs) of the real examples only when y is `Weighted`; else (y, outputs)."""
    if not isinstance(y, Weighted):
        return y, outputs
    real = y.weights > 0
    keep = lambda leaf: tf.boolean_mask(leaf, real)  # noqa: E731
    return tf.nest.map_structure(keep, y.labels), tf.nest.map_structure(keep, outputs)


def check_model(model: keras.Model) -> None:
    """Refuses padding for a model whose batch statistics the padded copies would change."""
    for layer in model._flatten_layers(include_self=False):  # noqa: SLF001 - Keras's walk
        if isinstance(layer, keras.layers.BatchNormalization):
            raise ConfigError(
                f"--drop_remainder=false pads short batches with copies of their examples, "
                f"which would change the batch statistics of the model's BatchNormalization "
                f"layer {layer.name!r}; use --drop_remainder=true")
