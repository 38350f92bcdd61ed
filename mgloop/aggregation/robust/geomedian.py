"""`geomedian:tolerance=,max_iterations=,smoothing=`: the geometric median of the towers'
whole gradient vectors by Weiszfeld's iterations (Pillutla et al. 2022, "Robust
aggregation for federated learning", RFA's smoothed Weiszfeld).

On the whole gradient vector (every variable flattened and concatenated, x_t tower t's),
the minimiser of F(z) = sum_t ||z - x_t||. From z_0 = (1/T) sum_t x_t:

    w_t = 1 / max(nu, ||z_k - x_t||),   z_{k+1} = sum_t w_t x_t / sum_t w_t

(nu = `smoothing`). Stopping rule with a certificate: the gradient of F at z_k is
grad F(z_k) = sum_t w_t (z_k - x_t) = (sum_t w_t)(z_k - z_{k+1}); the iterations stop at
the first k with ||grad F(z_k)|| <= tolerance * T and return z_{k+1}. F is convex and
both z_k and the minimiser z* lie in the towers' convex hull, of diameter D =
max_{s,t} ||x_s - x_t||, so F(z_k) - F(z*) <= ||grad F(z_k)|| ||z_k - z*||, and Weiszfeld
steps do not increase F:

    (1/T) (F(z_{k+1}) - F(z*)) <= tolerance * D

(while no iterate comes within nu of a tower's gradient; after `max_iterations` without
meeting the rule, z_{max_iterations} is returned uncertified). Tolerates up to half of
the towers Byzantine (breakdown point 1/2). On one or two towers the minimiser set
contains the mean, which is returned (exact, error_bound None). Otherwise the result is
a convex combination of the towers' whole gradients with the same weights for every
variable, so ||out[v] - mean[v]|| <= 2 G_v; with nearest-neighbour mixing first (`nnm=`,
nnm.py; needs T > 2 nnm, so none on two towers) the weights apply to mixed gradients,
themselves means of towers': still a convex combination, the same bound. Transport:
gathered on tower 0 and broadcast (gather_at_root.py).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import option
from mgloop.aggregation.placement.gather_at_root import GatherAtRoot, RobustOptions, flat_rows


def weiszfeld(rows: tf.Tensor, tolerance: float, max_iterations: int,
              smoothing: float) -> tuple[tf.Tensor, tf.Tensor]:
    """(the [T] weights w_t / sum w of the returned point, the iterations run) for the
    points rows [T, D], by the iterations and stopping rule of the module docstring."""
    num = rows.shape[0]
    uniform = tf.fill([num], 1.0 / num)

    def step(weights):
        z = tf.linalg.matvec(rows, weights, transpose_a=True)
        distances = tf.norm(rows - z, axis=1)
        w = 1.0 / tf.maximum(distances, smoothing)
        total = tf.reduce_sum(w)
        following = w / total
        z_next = tf.linalg.matvec(rows, following, transpose_a=True)
        gradient_norm = total * tf.norm(z - z_next)
        return following, gradient_norm <= tolerance * num

    def cond(k, weights, done):
        return tf.logical_and(k < max_iterations, tf.logical_not(done))

    def body(k, weights, done):
        following, converged = step(weights)
        return k + 1, following, converged

    k, weights, _ = tf.while_loop(cond, body, (tf.constant(0), uniform, tf.constant(False)))
    return weights, k


@dataclasses.dataclass(frozen=True)
class GeomedianOptions(RobustOptions):
    tolerance: float = option(1e-5, "stop once ||grad F|| <= tolerance * towers: then the "
                                    "mean distance is within tolerance * diameter of its "
                                    "minimum", low=0.0, low_open=True)
    max_iterations: int = option(100, "Weiszfeld iterations at most", low=1)
    smoothing: float = option(1e-8, "nu: distances below it count as nu", low=0.0,
                              low_open=True)


@register
class Geomedian(GatherAtRoot):
    name = "geomedian"
    options_type = GeomedianOptions

    @classmethod
    def error_bound(cls, options, num_towers):
        return None if num_towers <= 2 else 2.0 + 1e-5

    def combine(self, stacked):
        num = self.num_towers
        if num <= 2:  # the mean minimises F (any point between the two does)
            return [tf.reduce_sum(x, 0) * (1.0 / num) for x in stacked]
        o = self.options
        weights, _ = weiszfeld(flat_rows(stacked), o.tolerance, o.max_iterations, o.smoothing)
        return [tf.tensordot(weights, x, axes=1) for x in stacked]
