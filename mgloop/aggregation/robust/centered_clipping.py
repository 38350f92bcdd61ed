"""`centered_clipping:tau=,iterations=,center=` (Karimireddy, He & Jaggi 2021, "Learning
from history for Byzantine robust optimization", ICML).

On the whole gradient vector (x_t tower t's, every variable flattened and concatenated),
with L = `iterations` and the clipping radius tau:

    c_t(v) = min(1, tau / ||x_t - v||)                  (1 when x_t = v)
    v_{l+1} = v_l + (1/T) sum_t c_t(v_l) (x_t - v_l)     for l = 0, ..., L - 1
    out = v_L

One c_t per tower and iteration, from the distance over every variable, applied to
each variable's part (summed in tower order). The start v_0 (`center`):

- `previous` (the default, the paper's): the previous step's output, 0 before the first
  step. It is the method's state, one tensor per variable on tower 0 (`state_variables`:
  checkpointed and restored with the run, per node between workers by
  node_checkpoint.py, where every worker combines the same gathered bits and so holds
  the same centre); with --grad_reduce=sum it holds the mean estimate, not T times it.
  ByzFL's `CenteredClipping` (github.com/LPD-EPFL/byzfl; defaults L=1, tau=100, m=None)
  carries its output as the next call's start alike, from 0 on its first call.
- `zero`: v_0 = 0 every step (no state), what ByzFL's start m=None gives a fresh instance.

What it tolerates: a tower's pull on one iteration is at most tau / T in norm, whatever it
sends; the paper proves robustness to a small fraction delta of Byzantine inputs (its
analysis takes delta <= 0.1) with tau set from the spread of the honest ones, and runs
it on the workers' momenta (here: the towers' gradients, or what the optimizer makes of
them after). Defaults tau=100, iterations=1 (ByzFL's); tau is in gradient-norm units,
so it must suit the model: with tau at least every ||x_t - v_0|| every c_t is 1 and one
iteration lands on the mean; T identical gradients g farther than tau from v_0 move it
by tau toward g per iteration, not onto g.

Bound against the mean: write one iteration as v_{l+1} = (1 - a) v_l + sum_t (c_t / T)
x_t with a = (1/T) sum_t c_t in [0, 1]: a convex combination of v_l and the x_t with the
same weights for every variable, so ||v_{l+1}[v]|| <= max(||v_l[v]||, max_t ||x_t[v]||).
By induction over iterations and steps (v_0 is 0 or an earlier output) ||out[v]|| <= G_v,
the largest ||g[t][v]|| any tower has sent since `build`, hence

    ||out[v] - mean[v]|| <= 2 G_v                       (`error_bound`)

Exactly the mean when center=zero, iterations=1 and tau >= max_t ||x_t||: every
c_t is exactly 1 and v_1 = 0 + (1/T) sum_t x_t is the tower-order mean, bit for bit
(data-dependent, so error_bound is never None). From any v_0 with every c_t = 1, v_1 =
v_0 + (mean - v_0) equals the mean up to the roundings of those differences, their sum
(in any order) and the last addition: per element |v_1 - mean| <= (T + 4) u (|v_0| +
max_t |x_t|), u = 2^-24 float32's unit roundoff. With nearest-neighbour mixing first
(`nnm=`, nnm.py) the x_t are the mixed gradients, each a mean of towers': the same
bound. Transport: gathered on tower 0 and broadcast (gather_at_root.py).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import option
from mgloop.aggregation.placement.gather_at_root import GatherAtRoot, RobustOptions

CENTERS = ("previous", "zero")


def clip_factors(stacked: list[tf.Tensor], center: list[tf.Tensor], tau: float) -> tf.Tensor:
    """[T]: c_t = min(1, tau / ||x_t - v||) over every variable (1 where x_t = v)."""
    squares = tf.add_n([tf.reduce_sum(tf.reshape(tf.square(x - v), [x.shape[0], -1]), 1)
                        for x, v in zip(stacked, center)])
    norms = tf.sqrt(squares)
    return tf.where(norms > tau, tau / tf.maximum(norms, tau), tf.ones_like(norms))


def centered_clipping(stacked: list[tf.Tensor], center: list[tf.Tensor], tau: float,
                      iterations: int) -> list[tf.Tensor]:
    """v_L from v_0 = `center` (one tensor per variable) for the towers' values stacked[v]
    [T, *shape of v], by the iterations of the module docstring."""
    num = stacked[0].shape[0]
    v = list(center)
    for _ in range(iterations):
        c = clip_factors(stacked, v, tau)
        v = [vi + tf.reduce_sum((x - vi) * tf.reshape(c, [-1] + [1] * (x.shape.rank - 1)), 0)
             * (1.0 / num) for x, vi in zip(stacked, v)]
    return v


@dataclasses.dataclass(frozen=True)
class CenteredClippingOptions(RobustOptions):
    tau: float = option(100.0, "clipping radius (gradient-norm units): each tower's "
                               "difference to the centre counts at most tau", low=0.0,
                        low_open=True)
    iterations: int = option(1, "L: clipping iterations per step", low=1, high=100)
    center: str = option("previous", "v_0: previous = the last step's output (0 at the "
                                     "start; the paper's), zero = 0 every step",
                         choices=CENTERS)


@register
class CenteredClipping(GatherAtRoot):
    name = "centered_clipping"
    options_type = CenteredClippingOptions

    @classmethod
    def error_bound(cls, options, num_towers):
        return 2.0 + 1e-5

    def build(self, variables):
        self._center = []
        if self.options.center != "previous":
            return
        with tf.device(self.devices.towers[0]):  # where `combine` runs
            self._center = [tf.Variable(tf.zeros(tuple(v.shape), v.dtype), trainable=False,
                                        name=f"centered_clipping_center_{i}")
                            for i, v in enumerate(variables)]

    @property
    def state_variables(self):
        return list(getattr(self, "_center", []))

    def combine(self, stacked):
        o = self.options
        if self._center:
            start = [c.read_value() for c in self._center]
        else:
            start = [tf.zeros(x.shape[1:], x.dtype) for x in stacked]
        out = centered_clipping(stacked, start, o.tau, o.iterations)
        if not self._center:
            return out
        with tf.control_dependencies([c.assign(x) for c, x in zip(self._center, out)]):
            return [tf.identity(x) for x in out]
