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
define it (accuracy.py); any other loss gets none. A model with several outputs and a
loss per output (losses.PerOutput) gets one `<output>_accuracy` per output whose loss
defines one.

`KerasMetric` wraps a `keras.metrics.Metric` object: its state is the metric's own state
variables (Keras's `stateless_update_state` from zeros on the shard), flattened, and its
value Keras's `stateless_result` of the summed state. Only metrics whose every state
variable Keras aggregates by "sum" (Mean and every MeanMetricWrapper metric such as
BinaryAccuracy or MeanSquaredError, AUC, Precision, Recall, ...: the sum of the shards'
states is the state of their union) are taken; others, and metrics that build their state
on first use (R2Score, F1Score), are refused in one line. Each sum is float32 on a shard
(counts exact below 2^24), float64 from there on: the value is Keras's one-device value
on the global batch up to float32 rounding of the shards' totals.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import keras
import numpy as np
import tensorflow as tf

from mgloop.errors import ConfigError
from mgloop.training import accuracy
from mgloop.training import losses


class Metric(Protocol):
    name: str
    size: int

    def counts(self, y, outputs) -> tf.Tensor: ...

    def result(self, sums: np.ndarray) -> float | None: ...


class Accuracy:
    """correct / compared, by the loss's reading of a prediction (accuracy.py)."""

    size = 2

    def __init__(self, loss_fn, output: losses.OutputKey | None = None, name: str = "accuracy"):
        self.loss_fn, self.output, self.name = loss_fn, output, name

    def counts(self, y, outputs) -> tf.Tensor:
        return accuracy.counts(self.loss_fn, losses.select(y, self.output),
                               losses.select(outputs, self.output))

    def result(self, sums) -> float | None:
        return accuracy.accuracy_of(float(sums[0]), float(sums[1]))


class KerasMetric:
    """A keras.metrics.Metric whose states sum (see the module docstring), on one output."""

    def __init__(self, metric: keras.metrics.Metric, output: losses.OutputKey | None = None,
                 name: str | None = None):
        if not metric.variables or getattr(metric, "_built", True) is False or \
                getattr(metric, "built", True) is False:
            raise ConfigError(f"metrics: {type(metric).__name__} builds its state on its first "
                              "batch, so its per-tower states cannot be merged before; give a "
                              "metric whose state exists when made (e.g. Mean, BinaryAccuracy, "
                              "MeanSquaredError, AUC, Precision)")
        kinds = {v.path: getattr(v, "aggregation", None) for v in metric.variables}
        unsummed = {path: kind for path, kind in kinds.items() if kind != "sum"}
        if unsummed:
            raise ConfigError(f"metrics: {type(metric).__name__} has state {unsummed} that Keras "
                              "does not merge by summing, so towers' states cannot be merged "
                              "exactly; give a metric whose states are sums")
        self.metric, self.output = metric, output
        self.name = name or metric.name
        self.shapes = [tuple(v.shape) for v in metric.variables]
        self.dtypes = [v.dtype for v in metric.variables]
        self.size = int(sum(np.prod(shape, dtype=np.int64) for shape in self.shapes))

    def counts(self, y, outputs) -> tf.Tensor:
        y, outputs = losses.select(y, self.output), losses.select(outputs, self.output)
        zeros = [tf.zeros(shape, dtype) for shape, dtype in zip(self.shapes, self.dtypes)]
        state = self.metric.stateless_update_state(zeros, y, outputs)
        return tf.concat([tf.reshape(tf.cast(v, tf.float32), [-1]) for v in state], 0)

    def result(self, sums) -> float | None:
        values, start = [], 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            size = int(np.prod(shape, dtype=np.int64))
            values.append(tf.constant(np.reshape(sums[start:start + size], shape), dtype))
            start += size
        if not np.any(sums):
            return None  # nothing seen
        return float(self.metric.stateless_result(values))


def default_metrics(loss_fn) -> list[Metric]:
    """[Accuracy] where the loss defines an accuracy (accuracy.rule_for), else none; for a
    loss per output, `<output>_accuracy` for each output whose loss defines one."""
    if isinstance(loss_fn, losses.PerOutput):
        return [Accuracy(term, key, f"{key.name}_accuracy") for key, term, _ in loss_fn.terms
                if accuracy.rule_for(term) is not None]
    return [Accuracy(loss_fn)] if accuracy.rule_for(loss_fn) is not None else []


def log_text(values: dict, metrics: Sequence[Metric]) -> str:
    """'  NAME 0.xyz' for each metric in `values` (a log line's part after the loss)."""
    return "".join(f"  {m.name} {values[m.name]:.4g}" for m in metrics if m.name in values)


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


def values_of(values: dict, metrics: Sequence[Metric]) -> dict[str, float]:
    """"loss" and every metric of `values` (a window's or an eval's; absent: undefined)."""
    return {name: values[name] for name in ["loss", *(m.name for m in metrics)]
            if name in values}
