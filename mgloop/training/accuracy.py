"""Accuracy, where the loss says what a prediction is, and only there.

A tower (or the single-loss host, or an eval shard) counts, on its own device,

    counts = [correct, compared]   (float32 [2]; exact integers below 2^24 per step)

and every sum of them (over towers, micro-batches, steps, workers, eval
batches) adds both entries, so accuracy = sum(correct) / sum(compared): the
single-device value whatever the shard sizes. What is compared, per loss:

    categorical   (the default loss on K > 1 logits or on a softmax; Keras's
                  (Sparse)CategoricalCrossentropy): arg-max over the last axis
                  against the integer label, or against the arg-max of one-hot
                  labels (labels with the outputs' shape); one comparison per
                  example, or per token for outputs [B, L, K] with labels [B, L]
    binary        (the default loss on one logit or on a sigmoid; Keras's
                  BinaryCrossentropy): z > 0 on logits, p > 0.5 on probabilities,
                  against labels 0/1 (> 0.5) with the outputs' shape ([B] for one
                  unit also), element by element (multi-label: one per unit)

Any other loss (regression, a loss mgloop cannot read) has no accuracy:
counts are [0, 0], and the metrics leave accuracy out (`accuracy_of` is None).
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from mgloop.training import heads
from mgloop.training import losses


@dataclasses.dataclass(frozen=True)
class Rule:
    """How a prediction is read: `binary` True (element-wise threshold), False (arg-max),
    None (by the output width: one unit binary, else arg-max); `threshold` for binary."""

    binary: bool | None
    threshold: float = 0.0


_KERAS_CATEGORICAL = (keras.losses.SparseCategoricalCrossentropy,
                      keras.losses.CategoricalCrossentropy)
_KERAS_FUNCTIONS = {keras.losses.sparse_categorical_crossentropy: Rule(False),
                    keras.losses.categorical_crossentropy: Rule(False),
                    keras.losses.binary_crossentropy: Rule(True, 0.5)}


def rule_for(loss_fn) -> Rule | None:
    """The accuracy rule of a loss, or None where accuracy is not defined."""
    if isinstance(loss_fn, losses.CrossEntropy):
        return {heads.LOGITS: Rule(None, 0.0), heads.SOFTMAX: Rule(False),
                heads.SIGMOID: Rule(True, 0.5)}[loss_fn.outputs]
    if isinstance(loss_fn, (*_KERAS_CATEGORICAL, keras.losses.BinaryCrossentropy)):
        config = loss_fn.get_config()
        if config.get("ignore_class") is not None or config.get("label_smoothing"):
            return None  # tokens left out / soft targets: not a plain accuracy
        if isinstance(loss_fn, _KERAS_CATEGORICAL):
            return Rule(False)
        return Rule(True, 0.0 if config.get("from_logits") else 0.5)
    try:
        return _KERAS_FUNCTIONS.get(loss_fn)
    except TypeError:  # an unhashable callable
        return None


def counts(loss_fn, y: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
    """[correct, compared] (float32) of model outputs against labels, by `loss_fn`'s rule."""
    rule = rule_for(loss_fn)
    if rule is None:
        return tf.zeros([2], tf.float32)
    binary = rule.binary if rule.binary is not None else outputs.shape[-1] == 1
    if binary:
        threshold = rule.threshold
        if rule.binary is None and heads.activation_of(outputs) == heads.SIGMOID:
            threshold = 0.5  # the default loss on a model heads.py could not trace
        predicted = outputs > tf.cast(threshold, outputs.dtype)
        labels = tf.reshape(y, tf.shape(outputs))
        truth = tf.cast(labels, tf.float32) > 0.5
    else:
        predicted = tf.argmax(outputs, axis=-1, output_type=tf.int32)
        truth = (tf.argmax(y, axis=-1, output_type=tf.int32) if losses.is_one_hot(y, outputs)
                 else losses.class_ids(y, outputs))
    agree = tf.cast(tf.equal(predicted, truth), tf.float32)
    return tf.stack([tf.reduce_sum(agree), tf.cast(tf.size(agree), tf.float32)])


def accuracy_of(correct: float, compared: float) -> float | None:
    """correct / compared, or None when nothing was compared (accuracy not defined)."""
    return correct / compared if compared else None


def log_text(metrics: dict) -> str:
    """'  accuracy 0.xyz' for a log line, or '' where the metrics have no accuracy."""
    return f"  accuracy {metrics['accuracy']:.3f}" if "accuracy" in metrics else ""
