"""`--batch_norm=sync`: batch-norm statistics over the global batch, across the towers.

    per_tower (default)  each tower normalises with its own shard's statistics (what
        Keras `multi_gpu_model` did). After the step each tower's updated moving
        statistics are averaged over the towers (non_trainable.py), so
        the template holds m' = mu m + (1 - mu) (1/T) sum_t mean_t and
        v' = mu v + (1 - mu) (1/T) sum_t var_t: the mean of the per-shard (biased)
        variances, which lacks the spread of the shard means around the global mean.
    sync  every BatchNormalization layer of the template, on every tower, uses

        mean = (1/N) sum_t sum_{i in shard t} x_i
        var  = (1/N) sum_t sum_{i in shard t} (x_i - mean)^2       N = T x (shard count)

        the two sums all-reduced across the towers with TensorFlow's CollectiveReduceV2:
        tf.nn.moments over the global batch, as one device computes it, up to the
        order of the sums. Every tower then updates the moving statistics with the
        same global values, so the template holds the one device's moving statistics.
        The all-reduce's gradient is the all-reduce of the upstream gradients (each
        tower's sum feeds every tower's loss), so the aggregated gradient is the
        one device's gradient on the global batch.

The hook: `install(model)` replaces `_moments` on each BatchNormalization instance of
the template with a wrapper that, while the Trainer traces tower t inside
`CrossTowerMoments.tower(t)`, returns the cross-tower moments, and otherwise calls
the layer's own `_moments`. The model stays a plain Keras model: it saves its
config and weights only and loads without mgloop. The towers trace the same model
in the same order, so the k-th statistic of every tower is the same call site and
shares one collective instance key.
"""

from __future__ import annotations

import contextlib
import functools
import threading

from absl import logging
import keras
import tensorflow as tf

from mgloop.aggregation.dense import collective
from mgloop.aggregation.placement import collective_keys
_current = threading.local()  # .tower: (CrossTowerMoments, tower index, [call counter])


def batch_norm_layers(model: keras.Model) -> list[keras.layers.BatchNormalization]:
    return [layer for layer in model._flatten_layers(include_self=False)
            if isinstance(layer, keras.layers.BatchNormalization)]


def install(model: keras.Model) -> int:
    """Makes the model's BatchNormalization layers consult the current tower; returns their count."""
    layers = batch_norm_layers(model)
    for layer in layers:
        if not getattr(layer, "_mgloop_synced", False):
            layer._moments = functools.partial(_moments, layer, layer._moments)
            layer._mgloop_synced = True
    if not layers:
        logging.info("--batch_norm=sync: the model has no BatchNormalization layer")
    return len(layers)


def _moments(layer, own_moments, inputs, mask=None):
    context = getattr(_current, "tower", None)
    if context is None:
        return own_moments(inputs, mask)
    if mask is not None:
        raise ValueError(f"--batch_norm=sync: layer {layer.name} got a mask; synchronised "
                         "statistics of masked inputs are not supported, use per_tower")
    moments, tower, counter = context
    counter[0] += 2  # two all-reduce call sites per layer call
    return moments.moments(inputs, layer._reduction_axes, tower, counter[0] - 2)


class CrossTowerMoments:
    """Moments over the global batch for the towers on `devices` (one collective group)."""

    def __init__(self, devices: list[str]):
        self.devices = list(devices)
        self.group_key = collective_keys.new_group_key()
        self.tokens = collective.ordering_tokens(self.devices)
        self._keys: list[tuple[int, int]] = []  # (forward, backward) instance keys per site

    @contextlib.contextmanager
    def step(self):
        """Wraps the tracing of one training step: its call sites get fresh instance keys."""
        self._keys = []
        yield

    @contextlib.contextmanager
    def tower(self, index: int):
        """Batch-norm layers traced inside use tower `index`'s side of the all-reduces."""
        previous = getattr(_current, "tower", None)
        _current.tower = (self, index, [0])
        try:
            yield
        finally:
            _current.tower = previous

    def moments(self, x: tf.Tensor, axes, tower: int, site: int):
        """(mean, variance) over `axes` of the global batch, as tf.nn.moments computes them."""
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)) * len(self.devices),
                        x.dtype)
        total = self.all_reduce_sum(tf.reduce_sum(x, axes, keepdims=True), tower, site)
        mean = total / count
        squares = tf.reduce_sum(tf.math.squared_difference(x, tf.stop_gradient(mean)), axes,
                                keepdims=True)
        variance = self.all_reduce_sum(squares, tower, site + 1) / count
        return tf.squeeze(mean, axes), tf.squeeze(variance, axes)

    def all_reduce_sum(self, value: tf.Tensor, tower: int, site: int) -> tf.Tensor:
        """sum over towers of `value` (tower `tower`'s part), differentiable: d/dvalue of the
        sum is the sum of the towers' upstream gradients, all-reduced the same way."""
        while len(self._keys) <= site:
            self._keys.append((collective_keys.new_instance_key(),
                               collective_keys.new_instance_key()))
        forward_key, backward_key = self._keys[site]
        device, token = self.devices[tower], self.tokens[tower]

        def reduce(tensor, key):
            with tf.device(device):
                return tf.raw_ops.CollectiveReduceV2(
                    input=tensor, group_size=len(self.devices), group_key=self.group_key,
                    instance_key=key, ordering_token=[token.handle], merge_op="Add",
                    final_op="Id", communication_hint="auto")

        @tf.custom_gradient
        def summed(tensor):
            return reduce(tensor, forward_key), lambda upstream: reduce(upstream, backward_key)

        return summed(value)
