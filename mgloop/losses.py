"""The default loss: cross-entropy on logits, binary or categorical by the model's output width.

For labels y (integers) and logits z of one example,

    K > 1 logits:  loss = -log softmax(z)[y]                   (sparse categorical)
    1 logit:       loss = -y log s(z) - (1 - y) log(1 - s(z)),  s = sigmoid, y in {0, 1}

The one-logit case is the binary cross-entropy of a sigmoid output (e.g. `big_mlp`
on `random_binary`), computed by `tf.nn.sigmoid_cross_entropy_with_logits`
(max(z, 0) - z y + log(1 + exp(-|z|))), which stays finite where
log(sigmoid(z)) of a separate sigmoid would underflow. It returns one loss per
example; callers take the mean. `towers.count_correct` reads the same widths
(arg-max of K logits, z > 0 for one).
"""

from __future__ import annotations

import tensorflow as tf


def cross_entropy(y_true: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Per-example cross-entropy [B] of integer labels y_true [B] (or [B, 1]) and logits [B, K]."""
    if logits.shape[-1] == 1:
        labels = tf.cast(tf.reshape(y_true, [-1]), logits.dtype)
        return tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits[..., 0])
    labels = tf.cast(tf.reshape(y_true, [-1]), tf.int32)
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
