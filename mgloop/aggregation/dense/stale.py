"""`delay` and `drop`: stale and dropped towers on a parameter server (host CPU).

Both are methods of their own, parameter servers like `ps_cpu` (one shared copy on
the host, every tower reads it and sends its gradients there), because staleness
and backup workers are what asynchronous and backup-worker parameter servers do;
they do not combine with another method's exchange.

`delay:d=D,draw=fixed|random,seed=S` (a deterministic simulation of asynchronous
parameter-server training, Downpour/Hogwild-style delays). At step s tower t computes
its gradient on the parameters v(s - d_t) of step s - d_t (v(0) while s - d_t < 0),

    d_t = D                                          (draw=fixed)
    d_t ~ uniform{0, ..., D}, seeded by (S, s), drawn for every tower  (draw=random)

and the server applies (1/T) sum_t g[t] to the current parameters v(s). The
snapshots v(s-D..s) are a ring buffer of D + 1 slots per variable beside it on the
host (slot j holds v(i) for the last i = j mod (D+1)): the method's state,
checkpointed, so a resumed run reads the snapshots the uninterrupted one would.
`d=0` is `ps_cpu` exactly (the towers read the variables themselves).

`drop:k=K,choose=seeded|arrival,seed=S` (backup workers, Chen et al. 2016,
"Revisiting distributed synchronous SGD"): every step the gradients of K of the T
towers are left out and

    g = (1/(T-K)) sum_{t kept} g[t]        (--grad_reduce=sum: T/(T-K) times that sum)

The K left out are drawn uniformly without replacement, seeded by (S, the method's
draw counter, checkpointed; `choose=seeded`), or are the K whose gradients were
computed last in this process (`choose=arrival`, read with tf.timestamp once each
tower's gradients exist: a measured order, not reproducible, and on logical CPU
towers only the order in which this process happened to finish them). Every tower
still sends its gradient (counted in the traffic); the server leaves the dropped
ones out of the sum. The reported loss and metrics are over every tower's shard.
||g - (1/T) sum_t g[t]|| <= 2K/T max_t ||g[t]|| (the declared error bound).
`drop:k=0` is `ps_cpu`'s mean.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import Options, option
from mgloop.aggregation.compression.transport import ring_all_gather
from mgloop.aggregation.dense.parameter_server import _ParameterServer
from mgloop.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DelayOptions(Options):
    d: int = option(1, "D: tower t computes on the parameters of step s - d_t", low=0)
    draw: str = option("fixed", "d_t = D for every tower, or drawn uniformly from 0..D per "
                                "tower per step (seeded)", choices=("fixed", "random"))
    seed: int = option(0, "seed of the random delays", low=0)


@register
class Delay(_ParameterServer):
    name = "delay"
    options_type = DelayOptions
    capabilities = _ParameterServer.capabilities.but(
        exact=False,  # by design stale: not the synchronous update unless d=0
        identity="d=0", across_workers=False)

    def build(self, variables):
        """The ring buffer: D + 1 slots per variable, every one v(0), beside it."""
        self._buffers = []
        slots = self.options.d + 1
        if self.options.d == 0:
            return
        for v in variables:
            with tf.device(v.device):
                self._buffers.append(tf.Variable(
                    tf.repeat(v.read_value()[None], slots, axis=0), trainable=False,
                    name=f"delay_snapshots/{v.name.split(':')[0]}"))

    @property
    def state_variables(self):
        return list(self._buffers)

    def delays(self) -> tf.Tensor:
        """int64 [T]: d_t of the step now running (the same on every call in a step)."""
        d, num = self.options.d, self.num_towers
        if self.options.draw == "fixed":
            return tf.fill([num], tf.constant(d, tf.int64))
        return tf.random.stateless_uniform(
            [num], seed=tf.stack([tf.constant(self.options.seed, tf.int64), self.step_counter]),
            minval=0, maxval=d + 1, dtype=tf.int64)

    def tower_values(self, tower, values):
        """v(s - d_t): slot (s - d_t) mod (D + 1) of each variable's buffer."""
        if not self._buffers:
            return values
        slot = (self.step_counter - self.delays()[tower]) % (self.options.d + 1)
        out = []
        for buffer in self._buffers:
            with tf.device(buffer.device):
                out.append(tf.gather(buffer, slot))
        return out

    def after_update(self, copies):
        """v(s + 1) into slot (s + 1) mod (D + 1)."""
        if not self._buffers:
            return []
        slot = (self.step_counter + 1) % (self.options.d + 1)
        for buffer, variable in zip(self._buffers, copies[0].trainable):
            with tf.device(buffer.device):
                buffer.scatter_nd_update(slot[None, None], variable.read_value()[None])
        return []


@dataclasses.dataclass(frozen=True)
class DropOptions(Options):
    k: int = option(1, "K: towers whose gradients are left out each step", low=0)
    choose: str = option("seeded", "which: a seeded uniform draw, or the last K to finish",
                         choices=("seeded", "arrival"))
    seed: int = option(0, "seed of the draws", low=0)


@register
class Drop(_ParameterServer):
    name = "drop"
    options_type = DropOptions
    capabilities = _ParameterServer.capabilities.but(
        exact=False,
        sums_at_home=False,  # the dropped towers are left out inside `reduce` alone
        across_workers=False)

    @classmethod
    def error_bound(cls, options, num_towers):
        return 2.0 * options.k / num_towers if options.k else None

    @classmethod
    def reproducible(cls, options):
        return options.choose != "arrival"

    @classmethod
    def check(cls, request, options):
        if options.k >= request.num_towers:
            raise ConfigError(
                f"--aggregation=drop:k={options.k} leaves out {options.k} of "
                f"{request.num_towers} towers; use k= from 0 to {request.num_towers - 1}")

    def build(self, variables):
        with tf.device(self.devices.host):
            self._draws = tf.Variable(0, dtype=tf.int64, trainable=False, name="drop_draws")

    @property
    def state_variables(self):
        return [self._draws]

    def kept(self, tower_values) -> tf.Tensor:
        """bool [T]: the towers whose gradients count this step."""
        num, k = self.num_towers, self.options.k
        if self.options.choose == "seeded":
            seed = tf.stack([tf.constant(self.options.seed, tf.int64), self._draws])
            order = tf.argsort(tf.random.stateless_uniform([num], seed=seed))
            self._draws.assign_add(1)
        else:
            stamps = []
            for device, values in zip(self.devices.towers, tower_values):
                with tf.device(device), tf.control_dependencies(list(values)):
                    stamps.append(tf.timestamp())
            stamps = tf.stack(stamps)
            if self.peers is not None:  # every worker's arrival times, in tower order
                have = ring_all_gather(self, [(stamps,)], [self.devices.host], exact=True)[0]
                stamps = tf.concat([parts[0] for parts in have], 0)
            order = tf.argsort(stamps, direction="DESCENDING", stable=True)
        dropped = tf.scatter_nd(order[:k, None], tf.ones([k], tf.bool), [num])
        return tf.logical_not(dropped)

    def reduce(self, tower_values, variables, average=True):
        num, k = self.num_towers, self.options.k
        with tf.device(self.devices.host):
            keep = self.kept(tower_values)
        factor = 1.0 / (num - k) if average else num / (num - k)
        home, towers = self.parameter_devices()[0], self.devices.towers
        out = []
        for per_tower in zip(*tower_values):
            received = [self.send(g, src, home) for g, src in zip(per_tower, towers)]
            with tf.device(home):
                total = None
                for t, g in enumerate(received):
                    g = tf.where(keep[self.tower_offset + t], g, tf.zeros_like(g))
                    total = g if total is None else total + g
            if self.peers is not None:  # between workers: the kept sums of every worker
                total = self.peers.all_sum(self.traffic, total)
            with tf.device(home):
                out.append(total * tf.cast(factor, total.dtype))
        return [out]
