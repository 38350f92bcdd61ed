"""`bulyan:f=` (El Mhamdi et al. 2018, "The hidden vulnerability of distributed learning
in Byzantium").

Two stages, with T towers and f tolerated Byzantine ones:

1. Selection on the whole gradient vectors x_t (as Krum, krum.py): theta = T - 2f rounds;
   each round scores the n' towers not yet selected by Krum among themselves (the sum of
   squared distances to the k = n' - f - 2 nearest of them, at least 0 neighbours: with
   none, the lowest remaining index is taken) and moves the lowest-scoring one (lowest
   index on ties) into the selection S (|S| = theta).
2. Coordinate-wise, for every variable and element i: of the theta selected values, the
   beta = theta - 2f closest to their median (median.py; ties: earlier selected first)
   are averaged:  out_i = (1/beta) sum_{s in B_i} x_{s,i}.

Needs T >= 4f + 3 towers (refused otherwise, before building). f=0 selects every tower
and averages all of them: the mean (error_bound None). Otherwise every element lies
between the towers' smallest and largest, so ||out[v] - mean[v]|| <= 2 sqrt(T) G_v.
With nearest-neighbour mixing first (`nnm=`, nnm.py; needs T > 2 nnm) the mixed values
keep every element between the same smallest and largest, so the bound holds; f=0 then
averages the mixed gradients, a convex combination of the towers': within 2 G_v.
Transport: gathered on tower 0 and broadcast (gather_at_root.py).
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import option
from mgloop.aggregation.placement.gather_at_root import (GatherAtRoot, RobustOptions, flat_rows,
                                                         mixes)
from mgloop.aggregation.robust.krum import krum_scores, squared_distances
from mgloop.aggregation.robust.median import coordinate_median


def bulyan_selection(rows: tf.Tensor, f: int) -> tf.Tensor:
    """[theta] int32: tower indices in the order the Krum rounds select them."""
    num = rows.shape[0]
    distances = squared_distances(rows)
    remaining = tf.ones([num], tf.bool)
    chosen = []
    for round_ in range(num - 2 * f):
        left = num - round_
        scores = krum_scores(distances, max(left - f - 2, 0), remaining)
        pick = tf.argmin(scores, output_type=tf.int32)  # first index on ties
        chosen.append(pick)
        remaining = remaining & ~tf.one_hot(pick, num, on_value=True, off_value=False)
    return tf.stack(chosen)


def closest_to_median_mean(selected: tf.Tensor, beta: int) -> tf.Tensor:
    """Along axis 0 of selected [theta, ...]: the mean of the beta values per element
    closest to the element's median."""
    theta = selected.shape[0]
    if beta == theta:
        return tf.reduce_sum(selected, 0) * (1.0 / theta)
    distance = tf.abs(selected - coordinate_median(selected))
    nearest = tf.argsort(distance, axis=0, stable=True)[:beta]
    return tf.reduce_sum(_take(selected, nearest), 0) * (1.0 / beta)


def _take(values: tf.Tensor, index: tf.Tensor) -> tf.Tensor:
    """values[index[k, ...], ...] element-wise: the k-th chosen row of every element."""
    return tf.experimental.numpy.take_along_axis(values, index, axis=0)


@dataclasses.dataclass(frozen=True)
class BulyanOptions(RobustOptions):
    f: int = option(1, "Byzantine towers tolerated (needs towers >= 4f + 3)", low=0)


@register
class Bulyan(GatherAtRoot):
    name = "bulyan"
    options_type = BulyanOptions

    @classmethod
    def requirements(cls):
        """T >= 4f + 3 (and the mixing's T > 2 nnm)."""
        return {**super().requirements(),
                "f": ("4f + 3", lambda f: 4 * f + 3, lambda t: (t - 3) // 4)}

    @classmethod
    def error_bound(cls, options, num_towers):
        if options.f == 0:
            return 2.0 + 1e-5 if mixes(options) else None
        return 2 * math.sqrt(num_towers) + 1e-5

    def combine(self, stacked):
        f = self.options.f
        if f == 0:  # every tower selected, every value kept: the mean in tower order
            return [tf.reduce_sum(x, 0) * (1.0 / self.num_towers) for x in stacked]
        order = bulyan_selection(flat_rows(stacked), f)
        theta = self.num_towers - 2 * f
        return [closest_to_median_mean(tf.gather(x, order), theta - 2 * f) for x in stacked]
