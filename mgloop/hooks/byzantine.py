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
    def __init__(self, attack: Attack, count: int, choice: str, seed: int, global_step,
                 first_tower: int, total_towers: int, host: str):
        self.attack, self.count, self.random = attack, count, choice == "random"
        self.seed, self.global_step, self.host = seed, global_step, host
        self.first_tower, self.total_towers = first_tower, total_towers
        self._step = None
        self._flags = None

    @contextlib.contextmanager
    def step_scope(self):
        with tf.device(self.host):
            self._step = tf.cast(self.global_step.read_value(), tf.int64)
            if self.random:  # the k first of a seeded permutation of the towers
                keys = tf.random.stateless_uniform([self.total_towers], self._seed(-1))
                rank = tf.argsort(tf.argsort(keys))
                self._flags = tf.cast(rank < self.count, tf.float32)
            else:
                self._flags = tf.constant([1.0 if t < self.count else 0.0
                                           for t in range(self.total_towers)])
        yield

    def flags(self) -> tf.Tensor:
        return self._flags

    def _seed(self, *data: int) -> tf.Tensor:
        seed = tf.stack([tf.constant(self.seed, tf.int64), self._step])
        for value in (_STREAM,) + data:
            seed = tf.random.experimental.stateless_fold_in(seed, value)
        return seed

    def unscale(self, t, grads):
        tower = self.first_tower + t
        if not self.random and tower >= self.count:
            return grads  # an honest tower: nothing traced
        altered = [None if g is None else self._alter(g, tower, i) for i, g in enumerate(grads)]
        if not self.random:
            return altered
        chosen = self._flags[tower] > 0.5
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
