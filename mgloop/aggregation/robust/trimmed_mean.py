"""`trimmed_mean:trim=b`: the coordinate-wise trimmed mean (Yin et al. 2018).

For every variable v and element i, with the T towers' values sorted,
s_0 <= ... <= s_{T-1}, the b smallest and b largest are left out:

    out[v]_i = (1 / (T - 2b)) sum_{k=b}^{T-b-1} s_k

Needs T >= 2b + 1 towers (refused otherwise, before building); tolerates b Byzantine
towers per coordinate. trim=0 is the mean (summed in tower order, no sort: exact, so
error_bound None). Otherwise every element lies between the towers' smallest and largest,
so ||out[v] - mean[v]|| <= 2 sqrt(T) G_v (G_v the largest ||g[t][v]||). Coordinate-wise,
so per tensor. With nearest-neighbour mixing first (`nnm=f`, nnm.py; needs T > 2f) the
mixed values keep every element between the same smallest and largest, so the bound
holds; `trimmed_mean:trim=0,nnm=f` is the mean of the mixed gradients ("the mean with
NNM"), a convex combination of the towers' gradients: within 2 G_v of the mean.
Transport: gathered on tower 0 and broadcast (gather_at_root.py).
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import option
from mgloop.aggregation.kernels import sorting_network
from mgloop.aggregation.placement.gather_at_root import GatherAtRoot, RobustOptions, mixes


def trimmed_mean(x: tf.Tensor, trim: int) -> tf.Tensor:
    """Mean along axis 0 of x [T, ...] without the `trim` smallest and largest values."""
    num = x.shape[0]
    if trim == 0:
        return tf.reduce_sum(x, 0) * (1.0 / num)
    return sorting_network.trimmed_means([x], trim)[0]


@dataclasses.dataclass(frozen=True)
class TrimmedMeanOptions(RobustOptions):
    trim: int = option(1, "b: values left out at each end of every coordinate "
                          "(needs towers >= 2b + 1)", low=0)


@register
class TrimmedMean(GatherAtRoot):
    name = "trimmed_mean"
    options_type = TrimmedMeanOptions

    @classmethod
    def requirements(cls):
        """T >= 2b + 1 (and the mixing's T > 2 nnm)."""
        return {**super().requirements(),
                "trim": ("2b + 1", lambda b: 2 * b + 1, lambda t: (t - 1) // 2)}

    @classmethod
    def error_bound(cls, options, num_towers):
        if options.trim == 0:
            return 2.0 + 1e-5 if mixes(options) else None
        return 2 * math.sqrt(num_towers) + 1e-5

    def combine(self, stacked):
        if self.options.trim == 0:
            return [trimmed_mean(x, 0) for x in stacked]
        return sorting_network.trimmed_means(list(stacked), self.options.trim)
