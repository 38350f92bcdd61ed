"""`sparta` and `sparta_diloco`: replicas that average a small random part of their
parameters after every step.

SPARTA, sparse parameter averaging (Beton, Baioumy, van der Ouderaa, Reed, Howes, Cheema
and Vrabie 2025, "Improving the efficiency of distributed training using sparse
parameter averaging", OpenReview stFPf3gzq1; as EXO Gym's SPARTAStrategy and
SPARTADiLoCoStrategy, github.com/exo-explore/gym, exogym/strategy/sparta.py).

Inner steps as `localsgd` (local_steps.py): T copies, one per tower, each applying its
own tower's gradient with its own optimizer; no gradient exchange. Then, in
`after_update`, on every step s (0-based global step, `step_counter`) and for every
trainable variable i (n_i elements, flattened; copy c's values v_c):

    k_i = ceil(p n_i)                       p = `fraction` (EXO Gym's p_sparta = 0.005),
                                            read as the decimal it is written as
    J = J(S, s, i)                          k_i distinct indices in 0..n_i-1, ascending
                                            (`chosen`): the k_i elements with the largest
                                            keys u_j = stateless_uniform int64 (full
                                            range), seed fold_in(fold_in([S, s], D), i),
                                            S = --seed, D a domain constant; ties go to
                                            the lower index (top_k)
    a = (1/T) sum_c v_c[J]                  the chosen values of every variable, one vector
                                            per copy (one per dtype), averaged by the ring
                                            all-reduce (LocalSGD.ring_mean, ring.py: every
                                            copy gets the same bits; between workers the
                                            peers' collective, peers.py)
    v_c[J] <- a   on every copy c           the other elements are left alone.

J is a function of (S, s, i) alone: every copy and every worker draws it on its own
device, identically, and a run resumed at step s draws it again from the restored step
counter; so no index travels, only the k_i values (their own dtype).

Where mgloop differs from EXO Gym: EXO Gym draws a Bernoulli(p) mask per element
(torch.bernoulli, a random count with mean p n_i) on rank 0 and broadcasts it; here the
count is fixed, k_i = ceil(p n_i), a uniform k_i-subset, so that the vector sent has a
static length (the ring cuts it into chunks when traced and the bytes are counted exactly)
and every variable, even a bias of ten elements, has at least one element averaged per
step. EXO Gym's broadcast of the mask (n_i bytes) is not needed: the draw is stateless.

`sparta_diloco` (EXO Gym's SPARTADiLoCoStrategy: the sparse communicator, then DiLoCo's,
after every inner step): the sparse averaging above on every step, then, on the steps
that close a period, (s + 1) mod H = 0, DiLoCo's outer step (local_steps.py's `diloco`:
a = mean of the copies, delta = x - a, outer Nesterov SGD, v_c <- x). EXO Gym's DiLoCo
syncs after step s when s mod H = 0 and s > 0 (its local step counter is read before it
is advanced), one step later than mgloop's `diloco`; here the schedule is `diloco`'s.

Traffic: the sparse ring sends every step (occasion "every step"): each copy sends and
receives 2 (T-1)/T sum_i k_i values (exactly: the ring's chunks of the vector of
sum_i k_i elements, ring.py), at the parameters' dtype (no --transport_dtype: as
`localsgd`); `sparta_diloco`'s full ring on the occasion "sync" as `diloco`'s. Between
nodes (--nodes, workers) the method runs on the node leaders; after every step each node's
other towers take their leader's parameters (between_nodes.py hands whole variables, within the
node: the chosen elements alone would do; within-node bytes are so overstated).

Identity: fraction=1 chooses every element (J = 0..n_i-1), so `sparta:fraction=1` does
`localsgd:period=1`'s ops on the same vector and is it bit for bit (tests/test_sparta.py):
synchronous training in exact arithmetic with a linear optimizer (SGD, momentum). So is
`sparta_diloco:fraction=1,period=1,outer_lr=1,outer_momentum=0` (x <- x - (x - a) = a,
a the mean of copies that are already equal), up to the roundings of the subtractions.

State: none besides `diloco`'s x and m (sparta_diloco); the copies' checkpoint
(`copies_differ`) holds this worker's replicas.
"""

from __future__ import annotations

import dataclasses
import fractions
import math

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import Options, option
from mgloop.aggregation.local.local_steps import DiLoCo, DiLoCoOptions, LocalSGD
from mgloop.training.variables import backing

_DOMAIN = 0x5A7A  # folded into the seed: SPARTA's stream apart from other methods'


def chosen_count(fraction: float, num_elements: int) -> int:
    """k = ceil(p n), p the decimal `fraction` is written as (0.005 is 1/200 exactly)."""
    return math.ceil(fractions.Fraction(str(fraction)) * num_elements)


def chosen(seed: int, step: tf.Tensor, index: int, num_elements: int, count: int) -> tf.Tensor:
    """J(S, s, i): `count` distinct int32 indices in 0..num_elements-1, ascending (top)."""
    if count >= num_elements:
        return tf.range(num_elements, dtype=tf.int32)
    base = tf.stack([tf.constant(seed, tf.int64), tf.cast(step, tf.int64)])
    pair = tf.random.experimental.stateless_fold_in(
        tf.random.experimental.stateless_fold_in(base, _DOMAIN), index)
    keys = tf.random.stateless_uniform([num_elements], pair, minval=None, maxval=None,
                                       dtype=tf.int64)
    return tf.sort(tf.math.top_k(keys, count, sorted=False).indices)


@dataclasses.dataclass(frozen=True)
class SpartaOptions(Options):
    fraction: float = option(0.005, "p: each variable averages ceil(p n) of its n elements, "
                                    "drawn afresh every step (EXO Gym's p_sparta)",
                             low=0.0, low_open=True, high=1.0)


@dataclasses.dataclass(frozen=True)
class SpartaDiLoCoOptions(DiLoCoOptions):
    fraction: float = option(0.005, "p: each variable averages ceil(p n) of its n elements "
                                    "every step", low=0.0, low_open=True, high=1.0)
    period: int = option(100, "H: inner steps between DiLoCo's outer steps (EXO Gym's H)",
                         low=1)


class SparseAveraging:
    """The sparse averaging after every step, for a LocalSGD subclass (module top); it
    runs between processes: ring_mean reaches them (peers.py)."""

    def __init__(self, devices, options=None, transport_dtype="float32", **construction):
        super().__init__(devices, options, transport_dtype, **construction)
        self.seed = tf.compat.v1.get_seed(None)[0] or 0  # --seed (set before make)

    def build(self, variables):
        """The sizes n_i and counts k_i of the trainable variables (nothing is saved)."""
        super().build(variables)
        self.sizes = [v.shape.num_elements() for v in variables]
        self.counts = [chosen_count(self.options.fraction, n) for n in self.sizes]

    def indices(self, index: int) -> tf.Tensor:
        """J(S, s, i) of variable `index` at the step now running (on the current device)."""
        return chosen(self.seed, self.step_counter, index, self.sizes[index],
                      self.counts[index])

    def average_chosen(self, copies) -> list:
        """Every copy's chosen elements take their mean over the copies (module top)."""
        picked, flats, where = [], [], []
        for copy in copies:
            with tf.device(copy.device):
                values = [tf.reshape(backing(v).read_value(), [-1]) for v in copy.trainable]
                spots = [self.indices(i) for i in range(len(values))]
                picked.append([tf.gather(flat, j) for flat, j in zip(values, spots)])
            flats.append(values)
            where.append(spots)
        means = self.ring_mean(picked, True)
        assigns = []
        for copy, values, spots, averages in zip(copies, flats, where, means):
            with tf.device(copy.device):
                for variable, flat, j, mean in zip(copy.trainable, values, spots, averages):
                    variable = backing(variable)
                    merged = tf.tensor_scatter_nd_update(flat, tf.expand_dims(j, 1), mean)
                    assigns.append(variable.assign(tf.reshape(merged, variable.shape)))
        return assigns

    def after_update(self, copies):
        if self.num_towers == 1:
            return []
        assigns = self.average_chosen(copies)
        with tf.control_dependencies(assigns):
            return [tf.constant(True)] + self.periodic(copies)

    def periodic(self, copies) -> list:
        """What runs after the sparse averaging on some steps (DiLoCo's outer step)."""
        return []

    def syncs(self):
        """None declared: the copies change every step, so between nodes every tower takes
        its leader's parameters after every step (between_nodes.py)."""
        return []


@register
class Sparta(SparseAveraging, LocalSGD):
    name = "sparta"
    options_type = SpartaOptions
    capabilities = LocalSGD.capabilities.but(
        identity="fraction=1", runs_between_processes=True,  # ring_mean (SparseAveraging)
        unsummable_reason="it exchanges no gradients, only parameters after the update")
    warmup = 0  # no synchronous warmup
    averages_slots = False  # parameters only, as EXO Gym's sparse communicator


@register
class SpartaDiLoCo(SparseAveraging, DiLoCo):
    name = "sparta_diloco"
    options_type = SpartaDiLoCoOptions
    capabilities = DiLoCo.capabilities.but(
        identity="fraction=1,period=1,outer_lr=1,outer_momentum=0",
        runs_between_processes=True)  # ring_mean (SparseAveraging)

    def periodic(self, copies):
        """DiLoCo's outer step on the steps that close a period (LocalSGD.after_update)."""
        return DiLoCo.after_update(self, copies)
