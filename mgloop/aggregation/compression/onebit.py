"""`onebit:memory=residual`: 1-bit SGD with error feedback (Seide et al. 2014, "1-bit stochastic
gradient descent and its application to data-parallel distributed training of speech DNNs").

On tower t, x_t = g_t + e_t (flattened, n elements). Each entry is sent as one bit,
b_i = [x_i >= 0], and decoded to one of two per-tensor reconstruction values, the means of
the entries on its side (Seide et al. choose them per column to minimise the squared error;
here per tensor):

    mu+ = mean{x_i : x_i >= 0},  mu- = mean{x_i : x_i < 0}   (0 for an empty side)
    c_t = mu+ where b_i, mu- elsewhere;   e_t <- x_t - c_t     (memory=residual, the paper's)

Transport: gather (transport.py): each tower's two values differ, so payloads are not
summable; every tower receives the T-1 others' (bits, [mu+, mu-]), decodes them and adds the
T contributions in tower order: out = (1/T) sum_t c_t. The bits travel packed, 8 to a
byte (bitpacking.py), the two means as float32 at --transport_dtype:
(T-1) (ceil(n/8) + 8) bytes sent and received per tower and variable.
Bound: the side means minimise the squared error on each side, so
||x - c||^2 = ||x||^2 - n+ mu+^2 - n- mu-^2 <= (1 - 1/n) ||x||^2 (n_s mu_s^2 = (sum_s x)^2 / n_s
>= sum_s x^2 / n): q = sqrt(1 - 1/n), rho = q without memory, 2 q / (1 - q) with it.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.compression.base import Compressed, CompressionOptions, memory_option
from mgloop.aggregation.compression.signs import SignContracted
from mgloop.aggregation.compression.transport import GATHER
from mgloop.aggregation.kernels import bitpacking


def side_mean(x: tf.Tensor, side: tf.Tensor) -> tf.Tensor:
    """Mean of x where `side` (bool) holds; 0 where it holds nowhere."""
    count = tf.reduce_sum(tf.cast(side, x.dtype))
    total = tf.reduce_sum(tf.where(side, x, tf.zeros_like(x)))
    return tf.math.divide_no_nan(total, count)


@dataclasses.dataclass(frozen=True)
class OneBitOptions(CompressionOptions):
    memory: str = memory_option("residual", "Seide et al. 2014")


@register
class OneBit(SignContracted, Compressed):
    name = "onebit"
    options_type = OneBitOptions
    transport = GATHER

    def compress(self, x, site):
        bits = x >= 0
        return bits, tf.stack([side_mean(x, bits), side_mean(x, tf.logical_not(bits))])

    def pack(self, payload, site):
        """The bits at 1 bit each (bitpacking.py); the two means as they are."""
        bits, means = payload
        return bitpacking.pack_levels(tf.cast(bits, tf.int32), 1), means

    def unpack_rows(self, wires, site):
        packed, means = wires
        return bitpacking.unpack_levels_rows(packed, site.size, 1) > 0, means

    def decompress(self, payload, site):
        bits, means = payload
        return tf.where(bits, means[0], means[1])

    def decompress_rows(self, payloads, site):
        bits, means = payloads
        return tf.where(bits, means[:, :1], means[:, 1:])
