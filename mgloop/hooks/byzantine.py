"""`--byzantine_towers`: the hook that alters the chosen towers' gradients before the
exchange (what and which: mgloop/byzantine.py).

`step_scope` draws (or fixes) the step's set of altered towers from the global step; tower
t's `unscale` returns g' for every variable if t is in it, else g unchanged. Placed first
among the step's hooks, so its `unscale` runs last: after loss unscaling, before
`after_tower`, `observe` (the diagnostics see what the tower sent) and the exchange.
`flags()` is the step's [W*T] float32 0/1 vector of altered towers (the diagnostics'
`tower_<t>/byzantine`).
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from mgloop.byzantine import Attack
from mgloop.hooks import Hook

_STREAM = 0x62797a  # keeps the attack's random streams apart from any other use of --seed


class ByzantineTowers(Hook):
    """`towers_per_unit` > 1 (the method between nodes, aggregation/nodes.py): the
    attackers are `count` of the nodes, every tower of an attacking node alters its
    gradient alike (the same noise draw per node), so the node's mean is the attack's."""

    def __init__(self, attack: Attack, count: int, choice: str, seed: int, global_step,
                 first_tower: int, total_towers: int, host: str, towers_per_unit: int = 1):
        self.attack, self.count, self.random = attack, count, choice == "random"
        self.seed, self.global_step, self.host = seed, global_step, host
        self.first_tower, self.per_unit = first_tower, towers_per_unit
        self.total_units = total_towers // towers_per_unit
        self._step = None
        self._flags = None

    @contextlib.contextmanager
    def step_scope(self):
        with tf.device(self.host):
            self._step = tf.cast(self.global_step.read_value(), tf.int64)
            if self.random:  # the k first of a seeded permutation of the units
                keys = tf.random.stateless_uniform([self.total_units], self._seed(-1))
                rank = tf.argsort(tf.argsort(keys))
                self._flags = tf.cast(rank < self.count, tf.float32)
            else:
                self._flags = tf.constant([1.0 if u < self.count else 0.0
                                           for u in range(self.total_units)])
        yield

    def flags(self) -> tf.Tensor:
        """[W*T] 0/1 per tower (a node's flag repeated over its towers)."""
        return tf.repeat(self._flags, self.per_unit) if self.per_unit > 1 else self._flags

    def _seed(self, *data: int) -> tf.Tensor:
        seed = tf.stack([tf.constant(self.seed, tf.int64), self._step])
        for value in (_STREAM,) + data:
            seed = tf.random.experimental.stateless_fold_in(seed, value)
        return seed

    def unscale(self, t, grads):
        unit = (self.first_tower + t) // self.per_unit
        if not self.random and unit >= self.count:
            return grads  # an honest tower: nothing traced
        altered = [None if g is None else self._alter(g, unit, i) for i, g in enumerate(grads)]
        if not self.random:
            return altered
        chosen = self._flags[unit] > 0.5
        return [g if a is None else tf.where(chosen, tf.convert_to_tensor(a),
                                             tf.convert_to_tensor(g))
                for g, a in zip(grads, altered)]

    def _alter(self, g, tower: int, index: int):
        name, options = self.attack.name, self.attack.options
        if name == "gaussian":
            dense = tf.convert_to_tensor(g)
            return options["std"] * tf.random.stateless_normal(
                tf.shape(dense), self._seed(tower, index), dtype=dense.dtype)
        factor = {"signflip": -options.get("factor", 1.0), "scaled": options.get("factor"),
                  "zero": 0.0}[name]
        if isinstance(g, tf.IndexedSlices):
            return tf.IndexedSlices(g.values * factor, g.indices, g.dense_shape)
        return g * factor
