"""`noloco:period=H,group=n,outer_lr=b,outer_momentum=a,gamma=g`: NoLoCo, no all-reduce
(Kolehmainen, Blagoev, Donaghy, Ersoy & Nies 2025, "NoLoCo: No-all-reduce Low Communication
Training Method for Large Models", arXiv 2506.10911).

Replicated layout, N nodes (one copy each, the method at the nodes), each with its own inner
optimizer, its own outer parameters x_i and outer velocity v_i (x_i starts as the initial
parameters, v_i at 0). Every H steps (the steps s with (s + 1) mod H = 0, k = (s + 1) / H
the outer step's number), the nodes are split into N / n groups of n by a permutation P_k of
0..N-1 drawn from (--seed, k) alike on every node (`groups_at`: P_k = argsort of N stateless
uniforms; node P_k[p] is in group p mod (N / n), the reference code's `batched`), and on
node i, with G its group and theta_j node j's copy (its inner parameters):

    xbar  = (1/n) sum_{j in G} x_j             the group's mean outer parameters
    gbar  = xbar - (1/n) sum_{j in G} theta_j   the group's mean outer gradient (x - theta)
    v_i  <- a v_i - b gbar - g (x_i - xbar)     NoLoCo's modified Nesterov step: the outer
                                                momentum step on the group's mean, and a pull
                                                of g toward the group's mean parameters
    x_i  <- x_i + v_i;   theta_i <- x_i

(the reference code, github:jkolehm/noloco, sparse_optimizer_c.py, sends x_j and
theta_j - x_j and sets g = b; here x_j and theta_j travel, the same bytes, and g is its own
option, default 0.7 = the default b). Sums over a group run in node order with each
non-member's term a 0 (exact), then one multiplication by 1/n, on node i's device; so the
members of a group compute the same xbar and gbar bits.

With n = N (`group=0`: one group) every x_i stays equal, the pull term is 0, and the step
is DiLoCo's without Nesterov (`diloco:nesterov=false`: m <- a m + delta, x <- x - b m) with
v = -b m; at N = n = 2 and b = 1 the two are bit-equal (tests/test_noloco.py). Identity
(`identity`): period=1,group=0,outer_lr=1,outer_momentum=0,gamma=0 sets every x_i to the
nodes' mean after every step, synchronous training with a linear optimizer (localsgd's).

Traffic: an outer step moves, per node, its x_i and theta_i to each of its n - 1 group peers
(2 (n - 1) P values of the transport's float32, P the parameters) and receives as much;
recorded on the occasion "sync", so a run's bytes per step average 1/H of it. Nothing is
all-reduced: with n = 2 each node talks to one peer, whatever N.

The model it produces (`global_model`): the mean of the nodes' outer parameters,
(1/N) sum_i x_i (the nodes differ between and after outer steps; the paper evaluates
each replica and their mean). State (checkpointed per node: `copies_differ`): x_i and v_i.

Refused: between workers (a group changes every outer step, so each worker would need a
collective for every peer it could draw, chosen at run time; not built: one process, --nodes
only), --node_failures (no rule for a group with a down member), a resized elastic job (each
node's x_i and v_i are its own), n that does not divide N.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from mgloop.aggregation import global_models, register
from mgloop.aggregation.base import canonical, option
from mgloop.aggregation.local import outer_schedule
from mgloop.aggregation.local.local_steps import DiLoCo
from mgloop.errors import ConfigError
from mgloop.training.variables import backing

_DOMAIN = 0x70C0  # folded into the seed: NoLoCo's draws apart from other methods'


def groups_at(seed: int, outer_step: tf.Tensor, nodes: int, size: int) -> tf.Tensor:
    """int32 [nodes]: the group of each node at outer step `outer_step` (module top): P =
    argsort of `nodes` uniforms from (seed, domain, outer step); node P[p] in group
    p mod (nodes / size)."""
    key = tf.stack([tf.constant(seed, tf.int64) * 65536 + _DOMAIN,
                    tf.cast(outer_step, tf.int64)])
    order = tf.argsort(tf.random.stateless_uniform([nodes], seed=key))
    position = tf.argsort(order)  # node -> its place in P
    return tf.math.floormod(position, nodes // size)


@dataclasses.dataclass(frozen=True)
class NoLoCoOptions(outer_schedule.OuterMomentumOptions):
    period: int = option(16, "H: inner steps between outer steps", low=1)
    group: int = option(2, "n: nodes per group at an outer step (2: one random peer; 0: "
                           "every node, one group)", low=0)
    outer_lr: float = option(0.7, "b: the outer rate on the group's mean outer gradient",
                             low=0.0, low_open=True)
    outer_momentum: float = option(0.9, "a: the outer momentum", low=0.0, high=1.0,
                                   high_open=True)
    gamma: float = option(0.7, "g: the pull toward the group's mean outer parameters "
                               "(the reference code's g = b)", low=0.0)


@register
class NoLoCo(DiLoCo):
    name = "noloco"
    options_type = NoLoCoOptions
    capabilities = DiLoCo.capabilities.but(
        identity="period=1,group=0,outer_lr=1,outer_momentum=0,gamma=0",  # module top
        runs_between_processes=False,
        resize_refusal="each node's outer parameters and velocity are its own (NoLoCo: no "
                       "node holds another's); resume on the same number of workers")
    outer_parameters_differ = True
    momentum_is_velocity = True  # v = -b m: Pier's warmup fills v <- a v - b delta

    def __init__(self, devices, options=None, transport_dtype="float32", live=None,
                 **construction):
        super().__init__(devices, options, transport_dtype, live, **construction)
        self.seed = tf.compat.v1.get_seed(None)[0] or 0  # --seed (set before make)

    @classmethod
    def check(cls, request, options) -> None:
        nodes = request.num_towers
        if options.group == 1 or (nodes > 1 and options.group and nodes % options.group):
            raise ConfigError(
                f"--aggregation=noloco:group={options.group} on {nodes} nodes: a group size "
                f"must divide the nodes; use one of "
                f"{[n for n in range(2, nodes + 1) if nodes % n == 0]} or 0 (every node)")

    def groups(self) -> tf.Tensor:
        """Each node's group at the outer step now running (`groups_at`)."""
        outer_step = (self.step_counter + 1) // self.options.period
        return groups_at(self.seed, outer_step, self.num_towers, self.group_size)

    @property
    def group_size(self) -> int:
        """n: the option's, or every node with group=0."""
        return self.options.group or self.num_towers

    def synchronise(self, copies) -> None:
        """Every node's outer step on its group's means (module top), on its own device."""
        size, nodes = self.group_size, len(copies)
        b, a, g = self.options.outer_lr, outer_schedule.momentum(self), self.options.gamma
        groups = self.groups()
        inner = [[backing(v).read_value() for v in c.trainable] for c in copies]
        outer = [[x.read_value() for x in starts] for starts in self._start]
        for i, (copy, starts, velocities) in enumerate(zip(copies, self._start,
                                                           self._momentum)):
            with tf.device(copy.device):
                member = [tf.equal(groups[j], groups[i]) for j in range(nodes)]
                for v, (target, x, velocity) in enumerate(zip(copy.trainable, starts,
                                                              velocities)):
                    xs, thetas = [], []
                    for j in range(nodes):  # node order; a non-member adds an exact 0
                        xj, tj = outer[j][v], inner[j][v]
                        if j != i:
                            xj = self.receive(xj, copies[j].device, copy.device)
                            tj = self.receive(tj, copies[j].device, copy.device)
                        xs.append(tf.where(member[j], xj, tf.zeros_like(xj)))
                        thetas.append(tf.where(member[j], tj, tf.zeros_like(tj)))
                    x_sum, theta_sum = tf.add_n(xs), tf.add_n(thetas)  # one pass, in order
                    x_bar = x_sum * (1.0 / size)
                    g_bar = x_bar - theta_sum * (1.0 / size)
                    step = a * velocity - b * g_bar - g * (outer[i][v] - x_bar)
                    velocity.assign(step)
                    x.assign(x.read_value() + velocity.read_value())
                    target.assign(x.read_value())
        self.count_exchange(copies, size)

    def receive(self, value, src: str, dst: str) -> tf.Tensor:
        """Node j's tensor read on node i's device: counted by `count_exchange` (only the
        group's peers send; which they are is known at run time)."""
        with tf.device(dst):
            return tf.identity(value)

    def count_exchange(self, copies, size: int) -> None:
        """Per node: x_i and theta_i to each of its size - 1 peers, as much received."""
        values = sum(v.shape.num_elements() for v in copies[0].trainable)
        num_bytes = 2 * values * (size - 1) * self.transport_dtype.size
        for copy in copies:
            self.traffic.add(canonical(copy.device), sent=num_bytes, received=num_bytes,
                             messages_sent=2 * (size - 1), messages_received=2 * (size - 1),
                             tier="between")

    def rejoined(self, copies) -> None:  # never: a resize is refused (resize_refusal)
        raise ConfigError(f"--aggregation=noloco: {self.capabilities.resize_refusal}")

    def global_model(self, copies):
        """(1/N) sum_i x_i, on copy 0's device (one node: the copy itself)."""
        if self.num_towers == 1:
            return super().global_model(copies)
        return [tf.cast(x, v.dtype) for x, v in zip(
            global_models.mean_of(self._start, copies[0].device), copies[0].trainable)]

    def global_model_name(self) -> str:
        return ("copy 0 (one node)" if self.num_towers == 1
                else f"mean of the {self.num_towers} nodes' outer parameters")
