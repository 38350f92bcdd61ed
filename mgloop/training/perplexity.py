"""Perplexity of a sequence model: exp of the mean next-token cross-entropy.

A metric object of metrics.py. Each tower (or eval shard) counts, on its device,

    state = [sum over its tokens of the loss's cross-entropy, number of tokens]

(float32 [2]); the states add over towers, steps, workers and eval batches, so

    perplexity = exp(sum of token losses / number of tokens)

is exp of the mean token loss over everything summed: the one device's value on the
same global batches, whatever the shard sizes. It is a default metric (besides the
accuracy, which counts tokens too: accuracy.py) where the run's loss is the default
cross-entropy on logits or softmax outputs and the model's one output is a sequence
[B, L, K] with K > 1 (a language model); elsewhere mgloop adds none. The token losses
it sums leave out the model's own losses (regularisers).
"""

from __future__ import annotations

import math

import tensorflow as tf

from mgloop.training import heads
from mgloop.training import losses


class Perplexity:
    name, size = "perplexity", 2

    def __init__(self, loss_fn):
        self.loss_fn = loss_fn

    def counts(self, y, outputs) -> tf.Tensor:
        per_token = tf.cast(self.loss_fn(y, outputs), tf.float32)
        return tf.stack([tf.reduce_sum(per_token), tf.cast(tf.size(per_token), tf.float32)])

    def result(self, sums) -> float | None:
        if not sums[1]:
            return None
        mean = float(sums[0]) / float(sums[1])
        return math.exp(mean) if mean < 700 else math.inf  # exp overflows float64 past ~709


def for_sequences(loss_fn, model) -> list[Perplexity]:
    """[Perplexity] for a language model trained with the default cross-entropy, else []."""
    if not (isinstance(loss_fn, losses.CrossEntropy)
            and loss_fn.outputs in (heads.LOGITS, heads.SOFTMAX)):
        return []
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):  # a subclassed model has no symbolic outputs
        return []
    if not outputs or len(outputs) != 1:
        return []
    shape = outputs[0].shape
    return [Perplexity(loss_fn)] if len(shape) == 3 and (shape[-1] or 0) > 1 else []


def log_text(metrics: dict) -> str:
    """'  perplexity 12.34' for a log line, or '' where the metrics have none."""
    return f"  perplexity {metrics['perplexity']:.2f}" if "perplexity" in metrics else ""
