"""`topk:ratio=r,memory=residual`: each tower sends the k largest |entries| of each tensor.

Per variable of n elements, k = kept(r, n) = min(n, max(1, ceil(r n))). On tower t,
x_t = g_t + e_t (memory=residual, the default of Stich et al. 2018, "Sparsified SGD
with memory"; also Aji & Heafield 2017): the payload is (values x_t[I_t], indices
I_t) with I_t the positions of the k largest |x_t| (tf.math.top_k: ties to the lower
index), c_t = x_t on I_t and 0 elsewhere, e_t <- x_t - c_t (exactly: complementary
entries).

Transport: gather (transport.py). Each tower picks its own I_t, so payloads are not
summable; they are ring all-gathered and every tower adds the T scattered payloads
in tower order. Bytes per tower and variable: (T-1) k values at --transport_dtype
plus (T-1) k int32 indices, sent and received.

Bound: keeping the k largest of n entries leaves ||x - c|| <= q ||x||,
q = sqrt(1 - k/n) <= sqrt(1 - r). Without memory, ||c_t - g_t|| <= q G, so the mean
is within rho = q. With memory, ||e|| <= q (G + ||e||) keeps ||e|| <= q G / (1 - q),
and out - mean = (1/T) sum_t (e_t(old) - e_t(new)) is within rho = 2 q / (1 - q).
Plus float32 roundings (T additions) and the transport cast (relative 2^-8 for
bfloat16, 2^-11 for float16, per value).
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import option
from mgloop.aggregation.compression.base import Compressed, CompressionOptions, memory_option
from mgloop.aggregation.compression.transport import GATHER

RATIO = dict(low=0.0, high=1.0, low_open=True)


def kept(ratio: float, n: int) -> int:
    """k = min(n, max(1, ceil(ratio * n))), with ratio * n rounded to 9 decimals first
    (so that 0.07 * 100 keeps 7, not 8)."""
    return min(n, max(1, math.ceil(round(ratio * n, 9))))


def rounding_bound(num_towers: int) -> float:
    """float32 additions of T terms plus the largest transport cast (bfloat16, 2^-8)."""
    return 2.0 ** -8 + 4 * num_towers * 2.0 ** -24


def sparse_payload(x: tf.Tensor, index: tf.Tensor) -> tuple:
    """(x[index], index): values at the positions `index` (int32)."""
    return tf.gather(x, index), tf.cast(index, tf.int32)


def scatter(payload: tuple, size: int) -> tf.Tensor:
    """Dense flat tensor of `size` holding payload's values at its indices, 0 elsewhere."""
    values, index = payload
    return tf.scatter_nd(tf.expand_dims(index, 1), values, [size])


@dataclasses.dataclass(frozen=True)
class TopKOptions(CompressionOptions):
    ratio: float = option(0.01, "fraction of each tensor's entries a tower sends (the "
                                "largest in magnitude)", **RATIO)
    memory: str = memory_option("residual", "Stich et al. 2018")


@register
class TopK(Compressed):
    name = "topk"
    options_type = TopKOptions
    transport = GATHER
    sparse_payload = True

    @classmethod
    def error_bound(cls, options, num_towers):
        q = math.sqrt(1.0 - options.ratio)
        bound = 2 * q / (1 - q) if options.memory == "residual" and q < 1 else q
        return bound + rounding_bound(num_towers)

    def compress(self, x, site):
        _, index = tf.math.top_k(tf.abs(x), kept(self.options.ratio, site.size))
        return sparse_payload(x, index)

    def decompress(self, payload, site):
        return scatter(payload, site.size)
