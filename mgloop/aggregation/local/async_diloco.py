"""`async_diloco:period=H,delay=N,activation=c,quorum=q,grace=G,dynamic=true`: asynchronous
DiLoCo for nodes of different speeds, between simulated nodes of one process (Liu, Chhaparia,
Douillard et al. 2024, "Asynchronous Local-SGD Training for Language Modeling", arXiv
2401.09135: delayed Nesterov (DN), dynamic local updates (DyLU); with q > 1 or G > 0 a quorum,
a grace window and a merge by tokens as in Decoupled DiLoCo, arXiv 2604.21428).

Time. mgloop's step is lock-step: every tower computes a gradient at every global step s. The
asynchrony is modelled, deterministically, in the link model's time: node i of speed s_i
(--node_speeds, one factor per node; left out: all 1) runs at r_i = s_i / max_j s_j of the
fastest node, whose step is the unit of time (global step s spans (s, s + 1]). Node i finishes
inner steps at the times k / r_i, so by the end of step s it has taken n_i(s) = floor((s + 1)
r_i) of them (r_i an exact fraction of the decimal speeds: integer arithmetic, the same in the
graph and in Python), and at step s it applies its inner update iff

    turn_i(s) = n_i(s) > n_i(s - 1)   and it is not waiting for a quorum (below);

otherwise its copies take no update (parameters, optimizer slots and step count frozen: the
guard of step/hooks/inner_turns.py, which also reads every node's rate schedule at s), so a
2x slower node takes half as many inner steps; a skipped step's towers are dropped.

Rounds (DyLU). Node i's round is H_i = max(1, ceil(H r_i)) inner steps (`dynamic=false`: H for
every node), so every round spans about H units of time (HALoS's reproduction of DyLU,
github:utnslab/halos `rescale_num_local_steps`, rounds up). A round starts from x_start_i, the
outer parameters x when the node (re)started, and ends with its arrival: its pseudo-gradient
Delta_i = x_start_i - theta_i goes up to the syncer, which holds x.

Merges. With q = 1 (the default, Liu et al.) each arrival is merged on arrival. Otherwise
an arrived node waits (no inner steps) for its merge: when q arrivals are pending and G more
steps have passed (`grace`, Decoupled DiLoCo's window for late arrivals; 0: at the q-th),
or at once when every node is, the syncer merges the pending ones by the tokens processed
(equal batches per inner step): Delta = (sum_j H_j Delta_j) / (sum_j H_j) (`quorum=0`:
every node). Arrivals within one step are taken in node order, a window's end after them.
Merge k = 0, 1, ... is one outer step, the delayed Nesterov step of Liu et al.'s algorithm (as
github:utnslab/halos opt.py DelayedNesterovOptimizer), with buffer b (0 at start):

    b <- b + Delta
    if (k + 1) mod N == 0:   m <- beta m + b / N
                             x <- x - lr ((1 - c N + c) beta m + Delta / N);   b <- 0
    else:                    x <- x - lr (c beta m + Delta / N)

(beta = outer_momentum, lr = outer_lr, N = delay, 0: the number of nodes; c = activation in
[0, 1/N], 0: momentum only every N-th merge). Every merged node restarts: theta_j <- x,
x_start_j <- x. Its staleness is the number of outer steps since its x_start (`staleness`:
the last per node, their sum and maximum, and the merges, as state; summary.json's
"async_staleness" and the async/... scalars: async_run.py).

Degenerate setting: equal speeds, q = 0, N = 1: DiLoCo with Nesterov but for the mean (the
weighted mean of x - theta_j here, x - the ring's mean of theta_j there): tests bound it.

Traffic: a merge moves, per merged node, Delta_i up (P values of --transport_dtype, one
message, on the occasion "async up, node i") and x down (as many, "async down, node i"), on
the steps async_clock.Clock gives (the graph's state machine in Python). The syncer's own
link is not modelled.

The model it produces (`global_model`): x. State (checkpointed): x, m, b, the pending sum,
per node x_start_i, inner steps done, waiting, version. Refused: between workers (it needs an
asynchronous collective or a parameter-server variable on a chief; not built),
--node_failures, a resize, --node_speeds at the towers; docs/methods/async-diloco.md.
"""

from __future__ import annotations

import dataclasses
import functools

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import Aggregation, Options, canonical, option
from mgloop.aggregation.local.async_clock import Clock
from mgloop.aggregation.local.local_steps import DiLoCo
from mgloop.aggregation.traffic import Occasion, Sync
from mgloop.errors import ConfigError
from mgloop.training.variables import backing


@dataclasses.dataclass(frozen=True)
class AsyncDiLoCoOptions(Options):
    period: int = option(16, "H: the fastest node's inner steps per round (DyLU scales the "
                             "others' by their speed)", low=1)
    outer_lr: float = option(0.7, "the outer learning rate", low=0.0, low_open=True)
    outer_momentum: float = option(0.9, "beta: the outer (delayed Nesterov) momentum",
                                   low=0.0, high=1.0, high_open=True)
    delay: int = option(0, "N: the momentum is updated every N merges (0: the number of "
                           "nodes; 1: Nesterov at every merge)", low=0)
    activation: float = option(0.0, "c in [0, 1/N]: the momentum applied between its "
                                    "updates", low=0.0, high=1.0)
    quorum: int = option(1, "q: arrivals merged at once (1: each on arrival; 0: every "
                            "node); an arrived node waits for its merge", low=0)
    grace: int = option(0, "G: steps the syncer waits after q arrivals for more (every node "
                           "pending merges at once)", low=0)
    dynamic: bool = option(True, "DyLU: node i's round is ceil(H r_i) inner steps (false: H)")


@register
class AsyncDiLoCo(DiLoCo):
    name = "async_diloco"
    options_type = AsyncDiLoCoOptions
    capabilities = DiLoCo.capabilities.but(
        identity="period=1,outer_lr=1,outer_momentum=0,delay=1,quorum=0",
        runs_between_processes=False,
        resize_refusal="each node's round (x_start, inner steps done) is its own; resume on "
                       "the same number of nodes")

    def __init__(self, devices, options=None, transport_dtype="float32", live=None,
                 node_speeds=None, **construction):
        super().__init__(devices, options, transport_dtype, live, **construction)
        o, nodes = self.options, self.num_towers
        if node_speeds and len(node_speeds) != nodes:
            raise ConfigError(f"--aggregation=async_diloco: --node_speeds gives "
                              f"{len(node_speeds)} speeds for the method's {nodes} units; "
                              "use --nodes=N with one speed per node")
        self.clock = Clock(node_speeds, nodes, o.period, o.dynamic, o.quorum, o.grace)
        self.delay = o.delay or nodes

    @classmethod
    def check(cls, request, options) -> None:
        nodes = request.num_towers
        if options.quorum > nodes:
            raise ConfigError(f"--aggregation=async_diloco:quorum={options.quorum} on {nodes} "
                              f"nodes: a quorum is at most the nodes (0: every node)")
        if options.activation > 1.0 / (options.delay or nodes):
            raise ConfigError(f"--aggregation=async_diloco:activation={options.activation:g}: "
                              f"c must be in [0, 1/N] (N = delay, 0: the nodes)")

    def build(self, variables):
        """x, m, b and the pending sum on the syncer (the host); x_start_i on node i; the
        integer state of the schedule on the host."""
        host, devices = self.devices.host, self.parameter_devices()

        def zeros(name, like=None):
            return [tf.Variable(tf.zeros(v.shape, v.dtype) if like is None
                                else v.read_value(), trainable=False,
                                name=f"async_{name}/{v.name.split(':')[0]}") for v in variables]
        with tf.device(host):
            self._x, self._m, self._b, self._pending = (
                zeros("x", True), zeros("m"), zeros("b"), zeros("pending"))
            ints = functools.partial(tf.Variable, tf.constant(0, tf.int64), trainable=False)
            self._done = [ints(name=f"async_done_{i}") for i in range(len(devices))]
            self._waiting = [ints(name=f"async_waiting_{i}") for i in range(len(devices))]
            self._version_at = [ints(name=f"async_version_{i}") for i in range(len(devices))]
            self._last_staleness = [ints(name=f"async_staleness_{i}")
                                    for i in range(len(devices))]
            self._merges, self._tokens = ints(name="async_merges"), ints(name="async_tokens")
            self._reached = ints(name="async_quorum_reached")
            self._stale_sum, self._stale_max = ints(name="async_stale_sum"), ints(
                name="async_stale_max")
        self._start = []
        for i, device in enumerate(devices):
            with tf.device(device):
                self._start.append(zeros(f"start_{i}", True))
        self._momentum = [[] for _ in devices]  # DiLoCo's name; the momentum is the syncer's

    @property
    def state_variables(self):
        ints = (self._done + self._waiting + self._version_at + self._last_staleness
                + [self._merges, self._tokens, self._stale_sum, self._stale_max, self._reached])
        return (self._x + self._m + self._b + self._pending
                + [v for vs in self._start for v in vs] + ints)

    def rejoined(self, copies) -> None:  # never: a resize is refused (resize_refusal)
        raise ConfigError(f"--aggregation=async_diloco: {self.capabilities.resize_refusal}")

    def applies(self, i: int, step) -> tf.Tensor:
        """Whether node i applies its inner update at `step` (the guard's and the clock's)."""
        return tf.logical_and(self.clock.turn(i, tf.cast(step, tf.int64)),
                              tf.equal(self._waiting[i], 0))

    def occasions(self, i: int) -> tuple[Occasion, Occasion]:
        clock = self.clock
        return (Occasion(f"async up, node {i}", lambda s: clock.arrives(i, s)),
                Occasion(f"async down, node {i}", lambda s: clock.restarts(i, s)))

    def syncs(self) -> list[Sync]:
        """A node's towers take its leader's parameters whenever a node restarted."""
        clock = self.clock
        return [Sync(Occasion("async restart", lambda s: bool(clock.events(s)[2])),
                     lambda: self._restarted)]

    def after_update(self, copies):
        if self.num_towers == 1:
            self._restarted = tf.constant(False)
            return []
        step = tf.cast(self.step_counter, tf.int64)
        self._counted = set()  # the nodes whose x down is counted in this trace (`restart`)
        stepped = [self.applies(i, step) for i in range(len(copies))]  # as the guard saw
        arrived = []
        for i, done in enumerate(self._done):
            count = done.read_value() + tf.cast(stepped[i], tf.int64)
            done.assign(count)
            arrived.append(tf.logical_and(stepped[i], tf.equal(count, self.clock.rounds[i])))
        restarted = []
        for i, copy in enumerate(copies):  # in node order

            def arrive(i=i, copy=copy):
                with self.traffic.on(self.occasions(i)[0]):
                    delta = self.pseudo_gradient(i, copy)
                self.arrive(i, delta, copies)
                return tf.constant(True)
            restarted.append(tf.cond(arrived[i], arrive, lambda: tf.constant(False)))
        if self.clock.grace:  # the window after the quorum has passed: merge what is pending
            late = tf.logical_and(self.pending_count() >= self.clock.quorum,
                                  step >= self._reached + self.clock.grace)
            restarted.append(tf.cond(late, lambda: self.merge_pending(copies),
                                     lambda: tf.constant(False)))
        self._restarted = tf.reduce_any(tf.stack(restarted))
        return restarted

    def pseudo_gradient(self, i, copy) -> list[tf.Tensor]:
        """Delta_i = x_start_i - theta_i on node i, received on the host (counted: one
        message of P values of the transport dtype up)."""
        with tf.device(copy.device):
            deltas = [s.read_value() - backing(v).read_value()
                      for s, v in zip(self._start[i], copy.trainable)]
        self._count(copy.device, deltas, up=True)
        return [self._moved(d, copy.device, self.devices.host) for d in deltas]

    def _moved(self, value, src: str, dst: str) -> tf.Tensor:
        """`value` on `dst` through the transport dtype (counted by `_count`)."""
        with tf.device(src):
            packed = tf.cast(value, self.transport_dtype)
        with tf.device(dst):
            return tf.cast(packed, value.dtype)

    def _count(self, device, values, up: bool) -> None:
        size = sum(v.shape.num_elements() for v in values) * self.transport_dtype.size
        if up:
            self.traffic.add(canonical(device), sent=size, messages_sent=1, tier="between")
        else:
            self.traffic.add(canonical(device), received=size, messages_received=1,
                             tier="between")

    def arrive(self, i: int, delta, copies) -> None:
        """Node i's arrival (module top): merged alone (q = 1), or pending until q are."""
        with tf.device(self.devices.host):
            if self.clock.quorum == 1 and not self.clock.grace:
                self.outer_step(delta)
                self.restart(i, copies[i])
                return
            weight = float(self.clock.rounds[i])
            for p, d in zip(self._pending, delta):
                p.assign_add(weight * d)
            self._tokens.assign_add(self.clock.rounds[i])
            self._waiting[i].assign(1)
            count = self.pending_count()
            self._reached.assign(tf.where(tf.equal(count, self.clock.quorum),
                                          tf.cast(self.step_counter, tf.int64), self._reached))
            now = tf.equal(count, self.num_towers)
            if not self.clock.grace:
                now = tf.logical_or(now, count >= self.clock.quorum)
            tf.cond(now, lambda: self.merge_pending(copies), lambda: tf.constant(False))

    def pending_count(self) -> tf.Tensor:
        with tf.device(self.devices.host):
            return tf.add_n([tf.identity(w) for w in self._waiting])

    def merge_pending(self, copies) -> tf.Tensor:
        """The pending arrivals' token-weighted merge (module top); the waiting restart."""
        with tf.device(self.devices.host):
            tokens = tf.cast(self._tokens, self._pending[0].dtype)
            self.outer_step([p / tokens for p in self._pending])
            for p in self._pending:
                p.assign(tf.zeros_like(p))
            self._tokens.assign(0)
        for j, copy in enumerate(copies):
            tf.cond(tf.equal(self._waiting[j], 1),
                    lambda j=j, copy=copy: self.restart(j, copy) or tf.constant(True),
                    lambda: tf.constant(False))
        return tf.constant(True)

    def outer_step(self, delta) -> None:
        """The delayed Nesterov step (module top) on the host; counts the merge."""
        lr, beta, n, c = (self.options.outer_lr, self.options.outer_momentum, self.delay,
                          self.options.activation)
        flush = tf.equal(tf.math.floormod(self._merges + 1, n), 0)
        coefficient = tf.where(flush, (1.0 - c * n + c) * beta, c * beta)
        for x, m, b, d in zip(self._x, self._m, self._b, delta):
            b.assign_add(d)
            m.assign(tf.where(flush, beta * m + b / n, m))
            x.assign(x - lr * (tf.cast(coefficient, x.dtype) * m + d / n))
            b.assign(tf.where(flush, tf.zeros_like(b), b))
        self._merges.assign_add(1)

    def restart(self, j: int, copy) -> None:
        """Node j takes x (x down: counted), records its staleness, starts a round."""
        with tf.device(self.devices.host):
            stale = self._merges - 1 - self._version_at[j]
            self._last_staleness[j].assign(stale)
            self._stale_sum.assign_add(stale)
            self._stale_max.assign(tf.maximum(self._stale_max, stale))
            self._version_at[j].assign(self._merges)
            self._done[j].assign(0)
            self._waiting[j].assign(0)
        with self.traffic.on(self.occasions(j)[1]):
            xs = [self._moved(x.read_value(), self.devices.host, copy.device) for x in self._x]
            if j not in self._counted:  # traced in each node's merge branch, sent once
                self._count(copy.device, xs, up=False)
                self._counted.add(j)
        with tf.device(copy.device):
            for target, start, x in zip(copy.trainable, self._start[j], xs):
                start.assign(x)
                backing(target).assign(tf.cast(x, target.dtype))

    def staleness(self) -> dict:
        """The merges' staleness so far (module top)."""
        return {"merges": int(self._merges.numpy()),
                "staleness_sum": int(self._stale_sum.numpy()),
                "staleness_max": int(self._stale_max.numpy()),
                "last_staleness": [int(v.numpy()) for v in self._last_staleness]}

    def global_model(self, copies):
        """x, the syncer's outer parameters (one node: the copy itself)."""
        if self.num_towers == 1:
            return Aggregation.global_model(self, copies)
        return [tf.cast(tf.convert_to_tensor(x), v.dtype)
                for x, v in zip(self._x, copies[0].trainable)]

    def global_model_name(self) -> str:
        return "copy 0 (one node)" if self.num_towers == 1 else "outer parameters x (syncer)"

