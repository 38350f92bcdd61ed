"""`krum:f=` and `multikrum:f=,m=` (Blanchard et al. 2017, "Machine learning with
adversaries: Byzantine tolerant gradient descent").

On the whole gradient vector, as in the paper (a gradient is one point of R^d): x_t is
tower t's gradient with every variable flattened and concatenated. With T towers and
f tolerated Byzantine ones, tower i's score is the sum of the squared distances to its
k = T - f - 2 nearest other towers:

    s_i = sum_{j in N_k(i)} ||x_i - x_j||^2

Krum returns the gradient of the tower with the lowest score (the lowest index on ties);
Multi-Krum the mean of the m lowest-scoring towers' gradients (ties: lower index first),
m = T - f by default (m=0). Needs T > 2f + 2 towers (T >= 2f + 3), refused otherwise
before building. multikrum with f=0, m=T is the mean (summed in tower order: exact,
error_bound None). Otherwise the result is a mean of some towers' whole gradients, so
for each variable ||out[v] - mean[v]|| <= 2 G_v (G_v the largest ||g[t][v]||). With
nearest-neighbour mixing first (`krum:f=,nnm=`, nnm.py; needs T > 2 nnm) the result is
a mean of mixed gradients, each a mean of towers' gradients: the same bound, and
multikrum:f=0,m=T,nnm>0 is no longer the mean (within 2 G_v of it).
Transport: gathered on tower 0 and broadcast (gather_at_root.py); the T x T distances are
formed there (T rows of D elements each, T times).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import option
from mgloop.aggregation.placement.gather_at_root import (GatherAtRoot, RobustOptions, flat_rows,
                                                         mixes)
from mgloop.aggregation.robust.nnm import squared_distances  # noqa: F401 (bulyan's, the tests')
from mgloop.aggregation.robust.nnm import squared_distances_of


def krum_scores(distances: tf.Tensor, neighbours: int, remaining=None) -> tf.Tensor:
    """[T]: s_i, the sum of tower i's `neighbours` smallest distances to the other towers
    (only those in `remaining`, a [T] bool mask, if given; towers outside it score +inf)."""
    num = distances.shape[0]
    off = ~tf.eye(num, dtype=tf.bool)
    if remaining is not None:
        off = off & remaining[None, :]
    masked = tf.where(off, distances, tf.fill(distances.shape, float("inf")))
    scores = tf.reduce_sum(tf.sort(masked, axis=1)[:, :neighbours], axis=1)
    if remaining is not None:
        scores = tf.where(remaining, scores, float("inf"))
    return scores


def lowest(scores: tf.Tensor, m: int) -> tf.Tensor:
    """[m] int32: the towers of the m lowest scores (ties: the lower index first), in
    ascending tower order."""
    return tf.sort(tf.argsort(scores, stable=True)[:m])


def chosen_mean(x: tf.Tensor, chosen: tf.Tensor, count: int) -> tf.Tensor:
    """(1/count) sum_{t in chosen} x[t]: only the chosen rows are read (a tower left out
    never enters the sum, even with an inf or NaN gradient)."""
    return tf.reduce_sum(tf.gather(x, chosen), 0) * (1.0 / count)


@dataclasses.dataclass(frozen=True)
class KrumOptions(RobustOptions):
    f: int = option(1, "Byzantine towers tolerated (needs towers > 2f + 2)", low=0)


@dataclasses.dataclass(frozen=True)
class MultiKrumOptions(RobustOptions):
    f: int = option(1, "Byzantine towers tolerated (needs towers > 2f + 2)", low=0)
    m: int = option(0, "towers averaged, those of lowest score (0: towers - f)", low=0)


@register
class Krum(GatherAtRoot):
    name = "krum"
    options_type = KrumOptions

    @classmethod
    def requirements(cls):
        """T >= 2f + 3 (and the mixing's T > 2 nnm)."""
        return {**super().requirements(),
                "f": ("2f + 3", lambda f: 2 * f + 3, lambda t: (t - 3) // 2)}

    @classmethod
    def error_bound(cls, options, num_towers):
        return 2.0 + 1e-5

    def chosen_count(self) -> int:
        return 1

    def selected(self, stacked: list[tf.Tensor]) -> tf.Tensor:
        """The chosen_count() towers of lowest score, ascending."""
        scores = krum_scores(squared_distances_of(stacked),
                             self.num_towers - self.options.f - 2)
        return lowest(scores, self.chosen_count())

    def combine(self, stacked):
        chosen = self.selected(stacked)
        return [chosen_mean(x, chosen, self.chosen_count()) for x in stacked]


@register
class MultiKrum(Krum):
    name = "multikrum"
    options_type = MultiKrumOptions

    @classmethod
    def requirements(cls):
        """Krum's, and T >= m (m = 0: T - f)."""
        return {**super().requirements(), "m": ("m", lambda m: m, lambda t: t)}

    @classmethod
    def error_bound(cls, options, num_towers):
        m = options.m or num_towers - options.f
        exact = options.f == 0 and m == num_towers and not mixes(options)
        return None if exact else 2.0 + 1e-5

    def chosen_count(self) -> int:
        return self.options.m or self.num_towers - self.options.f
