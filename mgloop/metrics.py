"""Training and evaluation metrics as objects whose per-tower states merge exactly.

A metric is any object with

    name                 its key in the logs, TensorBoard (train/NAME, eval/NAME), summary.json
    size                 the length of its state vector
    counts(y, outputs)   float32 [size]: the state of one shard (labels, model outputs), on
                         the device the shard is on
    result(sums)         the value, from the state summed over towers, micro-batches,
                         steps, workers and eval batches (numpy float64 [size]); None: not
                         defined for what was seen (left out of the reported metrics)

Every state is a sum, so merging is adding: the towers' states are added on the host,
ride with the mean loss through the exchange across workers
(`Aggregation.reduce_with_metrics`), and are added over steps in float64. A metric
whose value is a function of sums over examples (a mean, a ratio of counts) is then
the one device's value on the global batch, whatever the shard sizes.

`Accuracy` is the one mgloop gives by default (`default_metrics`), for the losses that
define it (accuracy.py); any other loss gets none.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import tensorflow as tf

from mgloop import accuracy


class Metric(Protocol):
    name: str
    size: int

    def counts(self, y, outputs) -> tf.Tensor: ...

    def result(self, sums: np.ndarray) -> float | None: ...


class Accuracy:
    """correct / compared, by the loss's reading of a prediction (accuracy.py)."""

    name, size = "accuracy", 2

    def __init__(self, loss_fn):
        self.loss_fn = loss_fn

    def counts(self, y, outputs) -> tf.Tensor:
        return accuracy.counts(self.loss_fn, y, outputs)

    def result(self, sums) -> float | None:
        return accuracy.accuracy_of(float(sums[0]), float(sums[1]))


def default_metrics(loss_fn) -> list[Metric]:
    """[Accuracy] where the loss defines an accuracy (accuracy.rule_for), else none."""
    return [Accuracy(loss_fn)] if accuracy.rule_for(loss_fn) is not None else []


def total_size(metrics: Sequence[Metric]) -> int:
    return sum(m.size for m in metrics)


def state(metrics: Sequence[Metric], y, outputs) -> tf.Tensor:
    """Every metric's counts of one shard, concatenated: float32 [total_size] (no op added
    for one metric whose counts already are float32 [size]: the step's cost stays as it was)."""
    parts = [_as_state(m, m.counts(y, outputs)) for m in metrics]
    if len(parts) == 1:
        return parts[0]
    return tf.concat(parts, 0) if parts else tf.zeros([0], tf.float32)


def _as_state(metric: Metric, counts) -> tf.Tensor:
    counts = tf.cast(counts, tf.float32)  # the same tensor if already float32
    return counts if counts.shape == [metric.size] else tf.reshape(counts, [metric.size])


def split(metrics: Sequence[Metric], sums) -> dict[str, np.ndarray]:
    """The concatenated sums, per metric name."""
    sums, out, start = np.asarray(sums, np.float64), {}, 0
    for m in metrics:
        out[m.name] = sums[start:start + m.size]
        start += m.size
    return out


def results(metrics: Sequence[Metric], sums_by_name: dict[str, np.ndarray]) -> dict[str, float]:
    """name -> value for every metric defined on what was summed (None left out)."""
    out = {}
    for m in metrics:
        value = m.result(sums_by_name[m.name]) if m.name in sums_by_name else None
        if value is not None:
            out[m.name] = value
    return out
