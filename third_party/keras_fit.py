"""Baselines trained with Keras `model.fit`: under MirroredStrategy, and the split/concat model.

`mirrored_fit_model` re-creates the Keras guide "Multi-GPU distributed
training" (TensorFlow backend): model and `compile` inside
`MirroredStrategy.scope()`, then `fit` on a dataset of global batches, which
Keras splits per replica; Keras scales each replica's mean loss by
1/replicas and the optimizer sums the replicas' gradients (mean semantics).

`SplitConcat` re-creates Keras 2's `multi_gpu_model` (and kuza55's
`make_parallel` before it): one template model whose variables live on the
host; the global batch is sliced into one contiguous part per device, each
device runs the template on its slice, the outputs are concatenated on the
host, and ONE loss over the concatenation is differentiated by ONE gradient
call (the variables are shared, so each variable's gradient is the sum of
the devices' contributions, placed where TensorFlow puts it). Keras 2 took
the device placement from the `tf.device` scopes active while the functional
graph was built; Keras 3 functional models do not record device scopes, so
the slicing, the per-device calls and the concatenation are written in a
subclassed model's `call`, which runs them inside those scopes.

Both are compiled with `jit_compile=False` (mgloop does not use XLA; Keras
also turns XLA off on CPU-only machines) and with no metric besides the loss.
"""

from __future__ import annotations

from typing import Callable

import keras
import tensorflow as tf

HOST = "/device:CPU:0"


def mirrored_fit_model(strategy: tf.distribute.Strategy, model_fn: Callable[[], keras.Model],
                       loss_fn, optimizer_fn: Callable[[], keras.optimizers.Optimizer],
                       steps_per_execution: int = 1) -> keras.Model:
    """A model compiled under `strategy`, ready for `fit` on global batches."""
    with strategy.scope():
        model = model_fn()
        model.compile(optimizer=optimizer_fn(), loss=loss_fn,
                      steps_per_execution=steps_per_execution, jit_compile=False)
    return model


class SplitConcat(keras.Model):
    """`multi_gpu_model(template, gpus=len(devices))`: slices per device, outputs concatenated."""

    def __init__(self, template: keras.Model, devices: list[str], host: str = HOST, **kwargs):
        super().__init__(**kwargs)
        self.template = template
        self.devices = list(devices)
        self.host = host

    def call(self, x, training=False):
        size = tf.shape(x)[0] // len(self.devices)
        outputs = []
        for index, device in enumerate(self.devices):
            with tf.device(device):
                end = (index + 1) * size if index + 1 < len(self.devices) else tf.shape(x)[0]
                outputs.append(self.template(x[index * size:end], training=training))
        with tf.device(self.host):
            return tf.concat(outputs, axis=0)


def split_concat_model(model_fn: Callable[[], keras.Model], loss_fn,
                       optimizer_fn: Callable[[], keras.optimizers.Optimizer],
                       devices: list[str], steps_per_execution: int = 1,
                       host: str = HOST) -> keras.Model:
    """The template built on the host, wrapped in SplitConcat and compiled (no strategy)."""
    with tf.device(host):
        template = model_fn()
        model = SplitConcat(template, devices, host)
        model.compile(optimizer=optimizer_fn(), loss=loss_fn,
                      steps_per_execution=steps_per_execution, jit_compile=False)
    return model
