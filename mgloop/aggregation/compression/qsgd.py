"""`qsgd:levels=s,bucket=d` and `terngrad`: stochastic, unbiased quantisers on scales the
towers share, their integer levels summed by the ring all-reduce.

QSGD (Alistarh et al. 2017, "QSGD: Communication-efficient SGD via gradient quantization
and encoding", eq. 1) quantises x (n elements, flattened) to s levels of a scale M:

    a_i = s |x_i| / M,   l_i = sgn(x_i) (floor(a_i) + b_i),   b_i ~ Bernoulli(a_i - floor(a_i))
    Q(x)_i = (M / s) l_i,   E[Q(x)] = x   whenever M >= |x_i|

The paper takes M = ||x||_2 per bucket of d consecutive entries (its bucketing: the variance
bound min(d / s^2, sqrt(d) / s) M^2 of its Lemma 3.1 then holds per bucket, where one scale
for a whole tensor of n entries would let it grow with n), each worker its own. TernGrad
(Wen et al. 2017, "TernGrad: ternary gradients to reduce communication in distributed deep
learning") is the case s = 1 with M = ||x||_inf per tensor (layer-wise), and shares M between
workers ("scaler sharing") so that the ternary values can be added; its gradient clipping
(`clip=c`, 2.5 as in the paper) first limits x to +-c sigma (sigma: the std of x's entries),
so M is at most c max_t sigma_t; what clipping removes is lost (memory=none, as the paper) or
kept in the residual (memory=residual); the bound below adds ||clip(x) - x|| <= ||x||. Both methods here share the scales: M_b = max_t ||x_t on bucket b|| (the 2-norm
for qsgd, the max-norm for terngrad), agreed first (the base's `agree`) by a ring all-gather
of the ceil(n / d) bucket norms of every tower, sent at float32 whatever --transport_dtype is
(scales.shared_max: every tower takes the maximum of the same numbers, never below any
tower's). Every tower's quantiser stays unbiased (M_b >= |x_ti| on its bucket), and the levels
are summable:

    out_i = (M_b(i) / s) (sum_t l_ti) / T      (the integer sum is exact: replicas bit-identical)

Transport: summable. l_t rides the ring all-reduce (ring.py) as the smallest signed integer
type that holds T s (int8 while T s <= 127, then int16, int32): 2 (T-1)/T n bytes sent and
received per tower and variable with int8, a quarter of float32's, plus (T-1) 4 ceil(n / d)
bytes for the agreement. No Elias coding or bit-packing (the paper's coding is not
implemented). The draws b_i come from tower t's own stateless stream (`site.tower_seed`).
Levels are clipped to s (a float32 norm may round just below the largest |x_i|). Across
workers each worker agrees on its own scales and the workers add their dense decoded sums
(base.py); every tower of the job draws its own stream (seeded by its global index).

memory=none by default (neither paper uses error feedback; `residual` adds it).
Bound (memory=none): |Q(x)_i - x_i| <= M_b(i) / s and Q(x)_i = 0 where x_i = 0; with k
entries per scale and b scales, sum_i M_b(i)^2 <= k sum_b max_t ||x_tb||^2 <= k min(T, b) G^2,
so ||out - mean|| <= (1/T) sum_t ||Q(x_t) - x_t|| <= c G with c = sqrt(k min(T, b)) / s;
with memory=residual, ||e_t|| <= c (G + ||e_t||) holds the residual to c G / (1 - c) only
when c < 1, the error of out within 2 c / (1 - c) G; otherwise no bound is stated (inf).
The variance is far smaller than this worst case (Lemma 3.1 above).
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import option
from mgloop.aggregation.compression import scales
from mgloop.aggregation.compression.base import Compressed, CompressionOptions, memory_option
from mgloop.aggregation.compression.transport import SUMMABLE
from mgloop.aggregation.kernels import bitpacking

MAX_LEVELS = 32767


def stochastic_levels(x: tf.Tensor, scale: tf.Tensor, levels: int,
                      uniform: tf.Tensor) -> tf.Tensor:
    """QSGD's integer levels of x (float32): sgn(x_i) min(s, floor(a_i) + [u_i < a_i -
    floor(a_i)]), a_i = s |x_i| / scale; uniform: draws in [0, 1) shaped like x."""
    safe = tf.where(scale > 0, scale, tf.ones_like(scale))  # x = 0: every level 0
    a = tf.abs(x) / safe * tf.cast(levels, x.dtype)
    low = tf.floor(a)
    magnitude = tf.minimum(low + tf.cast(uniform < a - low, x.dtype),
                           tf.cast(levels, x.dtype))
    return tf.sign(x) * magnitude


def bucket_size(bucket: int, n: int) -> int:
    """Entries per scale: d (`bucket`), or the whole tensor when d is 0 or n <= d."""
    return n if bucket <= 0 else min(bucket, n)


def bucket_norms(x: tf.Tensor, size: int, norm) -> tf.Tensor:
    """[ceil(n / size)] norms of consecutive runs of `size` entries of the flat x (the last
    run padded with zeros)."""
    n = x.shape.num_elements()
    count = -(-n // size)
    runs = tf.reshape(tf.pad(x, [[0, count * size - n]]), [count, size])
    return tf.norm(runs, ord=norm, axis=1)


def per_entry(scales_: tf.Tensor, size: int, n: int) -> tf.Tensor:
    """Each entry's bucket scale: scales_[i // size] for i < n."""
    return tf.reshape(tf.tile(scales_[:, None], [1, size]), [-1])[:n]


def levels_bound(levels, bucket, memory, num_towers, num_elements) -> float:
    """rho of the module docstring: c = sqrt(k min(T, b)) / s, k entries per scale, b scales."""
    size = bucket_size(bucket, num_elements)
    count = -(-num_elements // size)
    c = math.sqrt(size * min(num_towers, count)) / levels
    return scales.contraction_bound(c, memory, num_towers)


@dataclasses.dataclass(frozen=True)
class QsgdOptions(CompressionOptions):
    levels: int = option(8, "s, quantisation levels per sign (s = 1: {-M, 0, M}); sent as "
                            "int8 while towers x s <= 127", low=1, high=MAX_LEVELS)
    bucket: int = option(512, "d, consecutive entries that share one scale M (the paper's "
                              "bucketing); 0: one scale per tensor", low=0)
    memory: str = memory_option("none", "Alistarh et al. 2017")


@dataclasses.dataclass(frozen=True)
class TernGradOptions(CompressionOptions):
    clip: float = option(2.5, "c: entries beyond c standard deviations of the tensor are "
                              "clipped to +-c sigma before ternarising (the paper's gradient "
                              "clipping); 0: none", low=0.0)
    memory: str = memory_option("none", "Wen et al. 2017")


def clipped(x: tf.Tensor, clip: float) -> tf.Tensor:
    """TernGrad's gradient clipping: x limited to +-c sigma, sigma the std of x's entries."""
    if clip <= 0:
        return x
    limit = clip * tf.math.reduce_std(x)
    return tf.clip_by_value(x, -limit, limit)


class SharedScaleQuantiser(Compressed):
    """Compress with the levels of scales agreed by all towers (module docstring)."""

    transport = SUMMABLE
    norm: float  # the norm whose maximum over towers is the shared scale M

    @property
    def levels(self) -> int:
        return self.options.levels

    @property
    def bucket(self) -> int:
        return self.options.bucket

    @classmethod
    def error_bound(cls, options, num_towers):
        return math.inf  # grows with n: error_bound_for

    @classmethod
    def error_bound_for(cls, options, num_towers, num_elements):
        return levels_bound(getattr(options, "levels", 1), getattr(options, "bucket", 0),
                            options.memory, num_towers, num_elements)

    def quantised(self, x: tf.Tensor) -> tf.Tensor:
        """What is quantised of x (TernGrad: x clipped); x itself by default."""
        return x

    def agree(self, xs, sites):
        """M_b = max_t ||x_t on bucket b||, the same float32s on every tower."""
        size = bucket_size(self.bucket, sites[0].size)
        norms = []
        for x, site in zip(xs, sites):
            with tf.device(site.device):
                norms.append(bucket_norms(self.quantised(x), size, self.norm))
        return scales.shared_max(self, norms, [site.device for site in sites])

    def entry_scales(self, site) -> tf.Tensor:
        size = bucket_size(self.bucket, site.size)
        return per_entry(site.agreed, size, site.size)

    def compress(self, x, site):
        uniform = tf.random.stateless_uniform(tf.shape(x), site.tower_seed, dtype=x.dtype)
        levels = stochastic_levels(self.quantised(x), self.entry_scales(site), self.levels,
                                   uniform)
        return (tf.cast(levels, scales.sum_dtype(self.num_towers, self.levels)),)

    def pack(self, payload, site):
        """The signed levels |l| <= s at ceil(log2(s + 1)) + 1 bits each (bitpacking.py;
        s >= 256 levels travel as the integers they are)."""
        if bitpacking.level_bits(self.levels) > 8:
            return payload
        return (bitpacking.pack_signed_levels(payload[0], bitpacking.level_bits(self.levels)),)

    def unpack_rows(self, wires, site):
        if bitpacking.level_bits(self.levels) > 8:
            return wires
        return (bitpacking.unpack_signed_levels_rows(
            wires[0], site.size, bitpacking.level_bits(self.levels),
            scales.sum_dtype(self.num_towers, self.levels)),)

    def decompress(self, payload, site):
        return tf.cast(payload[0], site.dtype) * (
            self.entry_scales(site) / tf.cast(self.levels, site.dtype))


@register
class Qsgd(SharedScaleQuantiser):
    name = "qsgd"
    options_type = QsgdOptions
    norm = 2


@register
class TernGrad(SharedScaleQuantiser):
    name = "terngrad"
    options_type = TernGradOptions
    norm = math.inf
    levels = 1
    bucket = 0  # one scale per tensor (layer-wise, as the paper)

    @classmethod
    def error_bound_for(cls, options, num_towers, num_elements):
        if options.clip <= 0:
            return super().error_bound_for(options, num_towers, num_elements)
        # ||Q(clip x) - x|| <= sqrt(n) M + ||clip x - x|| <= (sqrt(n) + 1) G
        return scales.contraction_bound(math.sqrt(num_elements) + 1, options.memory,
                                        num_towers)

    def quantised(self, x):
        return clipped(x, self.options.clip)
