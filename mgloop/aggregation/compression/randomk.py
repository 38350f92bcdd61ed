"""`randomk:ratio=r,memory=none`: every tower sends the same seeded random k entries.

Per variable of n elements, k = kept(r, n) (topk.py). The indices I are k distinct
positions drawn from `site.shared_seed` (the positions of the k largest of n stateless
uniforms under that seed): the SAME on every tower in a step, new every step and
variable, restored with the step counter on resume. The payload is the k values
s * x_t[I] only; the indices never travel (every tower draws them).

Transport: summable. sum_t s x_t[I] is summed by the ring all-reduce (each tower sends
and receives 2 (T-1)/T * k values at --transport_dtype), and every tower scatters it
to I: out = (1/T) sum_t c_t with c_t = s x_t on I and 0 elsewhere.

memory=none (the default; Wangni et al. 2018): s = n / k, so E[c_t] = g_t (unbiased
over the draw of I); ||c_t - g_t|| <= max(n/k - 1, 1) ||g_t|| <= max(1/r - 1, 1) G = rho.
memory=residual (Stich et al. 2018, "Sparsified SGD with memory"): s = 1, e_t <- x_t - c_t
(exactly: complementary entries). Only the EXPECTED contraction is sqrt(1 - k/n): an
entry not drawn keeps accumulating, so no bound holds uniformly over steps and
`error_bound` is infinite.
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import option
from mgloop.aggregation.compression.base import Compressed, CompressionOptions, memory_option
from mgloop.aggregation.compression.topk import RATIO, kept, rounding_bound
from mgloop.aggregation.compression.transport import SUMMABLE


def shared_indices(size: int, k: int, seed: tf.Tensor) -> tf.Tensor:
    """k distinct positions in [0, size), a function of `seed` alone (int32)."""
    _, index = tf.math.top_k(tf.random.stateless_uniform([size], seed=seed), k)
    return index


@dataclasses.dataclass(frozen=True)
class RandomKOptions(CompressionOptions):
    ratio: float = option(0.01, "fraction of each tensor's entries sent, at positions drawn "
                                "from a seed shared by the towers", **RATIO)
    memory: str = memory_option("none", "Wangni et al. 2018; residual: Stich et al. 2018")


@register
class RandomK(Compressed):
    name = "randomk"
    options_type = RandomKOptions
    transport = SUMMABLE
    # its unpacked payloads are summed by the ring, never gathered
    capabilities = Compressed.capabilities.but(buckets_payloads=False)

    @classmethod
    def error_bound(cls, options, num_towers):
        if options.memory == "residual":
            return math.inf
        return max(1.0 / options.ratio - 1.0, 1.0) * (1 + rounding_bound(num_towers))

    def scale_of(self, site) -> float:
        return 1.0 if self.uses_memory else site.size / kept(self.options.ratio, site.size)

    def indices(self, site) -> tf.Tensor:
        return shared_indices(site.size, kept(self.options.ratio, site.size), site.shared_seed)

    def compress(self, x, site):
        values = tf.gather(x, self.indices(site))
        scale = self.scale_of(site)
        return (values * scale if scale != 1.0 else values,)

    def decompress(self, payload, site):
        return tf.scatter_nd(tf.expand_dims(self.indices(site), 1), payload[0], [site.size])
