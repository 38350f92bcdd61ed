"""`--histogram_every` as a hook: keeps the gradient variable copy 0 applies in the last
step (`last_grads`, one variable per trainable variable on copy 0's device), for the
gradient histograms written between loops (monitor.py)."""

from __future__ import annotations

import tensorflow as tf

from mgloop.step.hooks import Hook


class KeepLastGradients(Hook):
    def __init__(self, copy):
        with tf.device(copy.device):
            self.last_grads = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                               for v in copy.trainable]

    def after_exchange(self, grads):
        for keep, g in zip(self.last_grads, grads[0]):
            with tf.device(keep.device):
                keep.assign(tf.cast(g, keep.dtype))
        return [v.value() for v in self.last_grads]  # read after the writes
