"""`threshold:value=v,memory=residual`: every entry with |x| >= v is sent, the rest kept.

On tower t, x_t = g_t + e_t (memory=residual, the default: Strom 2015, "Scalable
distributed DNN training using commodity GPU cloud computing"), c_t = x_t where
|x_t| >= v and 0 elsewhere, e_t <- x_t - c_t (exactly: complementary entries, so
|e_t| < v entry-wise). value=0 sends everything: lossless.

Transport: summable, DENSE. Which entries pass is data-dependent, and mgloop counts
bytes while the step is traced (static shapes), so the c_t travel as dense tensors
(zeros included) on the ring all-reduce: 2 (T-1)/T of the tensor's bytes per tower,
the dense ring's. The method changes the values, not the bytes; a variable-size
transport (values and indices of the entries that pass) is not implemented.

Bound: without memory ||c_t - g_t|| <= ||g_t||, rho = 1. With memory the error is
absolute (|e| < v entry-wise: out is within 2 v sqrt(n) of the mean), not relative to
G, so `error_bound` is infinite.
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import option
from mgloop.aggregation.compression.base import Compressed, CompressionOptions, memory_option
from mgloop.aggregation.compression.topk import rounding_bound
from mgloop.aggregation.compression.transport import SUMMABLE


@dataclasses.dataclass(frozen=True)
class ThresholdOptions(CompressionOptions):
    value: float = option(0.01, "entries with |x| >= value are sent (0: every entry)", low=0.0)
    memory: str = memory_option("residual", "Strom 2015")


@register
class Threshold(Compressed):
    name = "threshold"
    options_type = ThresholdOptions
    transport = SUMMABLE
    buckets_payloads = False  # its unpacked payloads are summed by the ring, never gathered

    @classmethod
    def error_bound(cls, options, num_towers):
        if options.memory == "residual" and options.value > 0:
            return math.inf
        return 1.0 + rounding_bound(num_towers)

    def compress(self, x, site):
        return (tf.where(tf.abs(x) >= self.options.value, x, tf.zeros_like(x)),)

    def decompress(self, payload, site):
        return payload[0]
