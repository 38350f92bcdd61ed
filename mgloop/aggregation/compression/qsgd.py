"""`qsgd:levels=s` and `terngrad`: stochastic, unbiased quantisers on a scale the towers
share, their integer levels summed by the ring all-reduce.

QSGD (Alistarh et al. 2017, "QSGD: Communication-efficient SGD via gradient quantization
and encoding", eq. 1) quantises x (n elements, flattened) to s levels of a scale M:

    a_i = s |x_i| / M,   l_i = sgn(x_i) (floor(a_i) + b_i),   b_i ~ Bernoulli(a_i - floor(a_i))
    Q(x)_i = (M / s) l_i,   E[Q(x)] = x   whenever M >= max_i |x_i|

The paper takes M = ||x||_2, each worker its own. TernGrad (Wen et al. 2017, "TernGrad:
ternary gradients to reduce communication in distributed deep learning") is the case s = 1
with M = ||x||_inf, and shares M between workers ("scaler sharing") so that the ternary
values can be added. Both methods here share it: M = max_t ||x_t|| (the 2-norm for qsgd, the
max-norm for terngrad), agreed first (the base's `agree`) by a ring all-gather of one float32
per variable and tower, sent at float32 whatever --transport_dtype is (scales.shared_max:
every tower takes the maximum of the same T numbers, never below any ||x_t||).
Every tower's quantiser stays unbiased (M >= ||x_t|| >= |x_ti|), and the levels are summable:

    out = (M / s) (sum_t l_t) / T        (the integer sum is exact: replicas bit-identical)

Transport: summable. l_t rides the ring all-reduce (ring.py) as the smallest signed integer
type that holds T s (int8 while T s <= 127, then int16, int32): 2 (T-1)/T n bytes sent and
received per tower and variable with int8, a quarter of float32's, plus (T-1) 4 bytes for
the agreement. No Elias coding or bit-packing (the paper's coding is not implemented).
The draws b_i come from tower t's own stateless stream (`site.tower_seed`). Levels are
clipped to s (a float32 norm may round just below the largest |x_i|). Across workers each
worker agrees on its own M and the workers add their dense decoded sums (base.py); tower t
of every worker draws the same stream (the local tower index repeats), so every tower stays
unbiased but those draws are correlated between workers.

memory=none by default (neither paper uses error feedback; `residual` adds it).
Bound (memory=none): |Q(x)_i - x_i| <= M / s and Q(x)_i = 0 where x_i = 0, so
||out - mean|| <= (1/T) sum_t ||Q(x_t) - x_t|| <= c G with c = sqrt(n) / s (M <= G: for
terngrad the max-norm is at most the 2-norm); with memory=residual, ||e|| <= c (G + ||e||)
holds the residual to c G / (1 - c) only when c < 1, the error of out within 2 c / (1 - c) G;
otherwise no bound is stated (inf). The variance is far smaller than this worst case: QSGD's
Lemma 3.1, E||Q(x) - x||^2 <= min(n / s^2, sqrt(n) / s) M^2.
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


def levels_bound(levels, memory, num_towers, num_elements) -> float:
    """rho of the module docstring, c = sqrt(n) / s (inf where no bound is stated)."""
    return scales.contraction_bound(math.sqrt(num_elements) / levels, memory, num_towers)


@dataclasses.dataclass(frozen=True)
class QsgdOptions(CompressionOptions):
    levels: int = option(1, "s, the number of quantisation levels per sign (s = 1: "
                            "{-M, 0, M}); sent as int8 while towers x s <= 127",
                         low=1, high=MAX_LEVELS)
    memory: str = memory_option("none", "Alistarh et al. 2017")


@dataclasses.dataclass(frozen=True)
class TernGradOptions(CompressionOptions):
    memory: str = memory_option("none", "Wen et al. 2017")


class SharedScaleQuantiser(Compressed):
    """Compress with the levels of a scale agreed by all towers (module docstring)."""

    transport = SUMMABLE
    norm: float  # the norm whose maximum over towers is the shared scale M

    @property
    def levels(self) -> int:
        return self.options.levels

    @classmethod
    def error_bound(cls, options, num_towers):
        return math.inf  # grows with n: error_bound_for

    @classmethod
    def error_bound_for(cls, options, num_towers, num_elements):
        return levels_bound(getattr(options, "levels", 1), options.memory, num_towers,
                            num_elements)

    def agree(self, xs, sites):
        """M = max_t ||x_t||, the same float32 on every tower."""
        return scales.shared_max(self, [tf.norm(x, ord=self.norm) for x in xs],
                                 [site.device for site in sites])

    def compress(self, x, site):
        uniform = tf.random.stateless_uniform(tf.shape(x), site.tower_seed, dtype=x.dtype)
        levels = stochastic_levels(x, site.agreed, self.levels, uniform)
        return (tf.cast(levels, scales.sum_dtype(self.num_towers, self.levels)),)

    def decompress(self, payload, site):
        return tf.cast(payload[0], site.dtype) * (
            site.agreed / tf.cast(self.levels, site.agreed.dtype))


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
