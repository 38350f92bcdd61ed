"""`adasum`: adaptive summation (Maleki et al. 2021, "Scaling distributed training with
adaptive summation"; Horovod's `op=hvd.Adasum`).

The pairwise adaptive sum of two gradients a, b of one tensor:

    adasum(a, b) = (1 - a.b / (2 ||a||^2)) a + (1 - a.b / (2 ||b||^2)) b

(a term whose norm is 0 keeps coefficient 1: adasum(0, b) = b). Orthogonal gradients
are summed, parallel ones averaged: adasum(g, g) = g. Applied per tensor (each
variable's gradient is its own a, b, as Horovod computes the dot products and norms per
tensor of a fused buffer and the paper per layer), recursively over the towers as
Horovod's recursive doubling pairs them: level l combines the results of towers i and
i + 2^l for i a multiple of 2^(l+1), the lower-indexed one as a:

    T=4: adasum(adasum(g0, g1), adasum(g2, g3))

Needs a power-of-two tower count (as Horovod's AdasumMPI); others are refused in one
line before building. Mean semantics: Adasum of T identical gradients g is g (the mean);
of T mutually orthogonal ones, their sum; so it is not the mean in general (lossy, no
learning-rate rescaling is applied). ||adasum(a, b)||^2 = ||a||^2 + ||b||^2
- (3/4) c^2 (1/||a||^2 + 1/||b||^2) + c^3 / (2 ||a||^2 ||b||^2) <= ||a||^2 + ||b||^2
(c = a.b, |c| <= ||a|| ||b||), so ||out[v]||^2 <= sum_t ||g[t][v]||^2 <= T G_v^2 and
||out[v] - mean[v]|| <= (sqrt(T) + 1) G_v: `error_bound`. Dot products and squared norms
are accumulated in float64. Transport: gathered on tower 0 and broadcast
(gather_at_root.py; Horovod's recursive halving and doubling moves fewer bytes across
machines, the result is the same tree).
"""

from __future__ import annotations

import math

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.placement.gather_at_root import GatherAtRoot, refuse_towers


def pairwise_adasum(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """adasum(a, b) of the module docstring."""
    a64, b64 = tf.cast(a, tf.float64), tf.cast(b, tf.float64)
    dot = tf.reduce_sum(a64 * b64)
    coefficient_a = 1.0 - tf.math.divide_no_nan(dot, 2.0 * tf.reduce_sum(a64 * a64))
    coefficient_b = 1.0 - tf.math.divide_no_nan(dot, 2.0 * tf.reduce_sum(b64 * b64))
    return tf.cast(coefficient_a, a.dtype) * a + tf.cast(coefficient_b, b.dtype) * b


def recursive_adasum(values: list[tf.Tensor]) -> tf.Tensor:
    """The tree of the module docstring over values[0..T-1], T a power of two."""
    level = list(values)
    while len(level) > 1:
        level = [pairwise_adasum(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@register
class Adasum(GatherAtRoot):
    name = "adasum"

    @classmethod
    def check(cls, request, options):
        num = request.num_towers
        if not is_power_of_two(num):
            lower = 1 << (num.bit_length() - 1)
            refuse_towers(cls, request, options, "a power-of-two count of",
                          "(its pairwise tree, as Horovod's)", is_power_of_two,
                          f"{lower} or {2 * lower}")

    @classmethod
    def error_bound(cls, options, num_towers):
        return None if num_towers == 1 else math.sqrt(num_towers) + 1.0 + 1e-5

    def combine(self, stacked):
        return [recursive_adasum(tf.unstack(x)) for x in stacked]
