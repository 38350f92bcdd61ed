"""`--byzantine_towers`: the hook that alters the chosen units' gradients before the
exchange (what and which: mgloop/step/hooks/attacks.py).

`step_scope` draws (or fixes) the step's set of attacking units from the global step. Then,
by the kind of attack:

    per tower (signflip, scaled, gaussian, zero)  tower t's `unscale` returns g' for every
                 variable if t's unit attacks, else g unchanged. Placed first among the
                 step's hooks, so its `unscale` runs last: after loss unscaling, before
                 `after_tower`, `observe` (the diagnostics see what the tower sent) and the
                 exchange.
    labelflip    tower t's `labels` returns y' = C - 1 - y (one-hot rows reversed) if its
                 unit attacks: the tower then computes an honest gradient of poisoned data.
    alie, ipm    `alter_towers` (once every tower's gradient exists, before `observe` and
                 the exchange): per variable, the units' gradients (a node's: the mean of its
                 towers') are stacked on the host, mu and sigma taken over the honest ones,
                 and every tower of an attacking unit gets the attack vector on its device.

With --byzantine_choice=random the choice is a `tf.where` on the step's flag, so the step
has no branch. `flags()` is the step's [W*T] float32 0/1 vector of altered towers (the
diagnostics' `tower_<t>/byzantine`).
"""

from __future__ import annotations

import contextlib

from absl import logging
import tensorflow as tf

from mgloop.data import padding
from mgloop.step.hooks import Hook
from mgloop.step.hooks.attacks import OMNISCIENT, PER_TOWER, Attack, alie_z
from mgloop.training import losses

_STREAM = 0x62797a  # keeps the attack's random streams apart from any other use of --seed


class ByzantineTowers(Hook):
    """`towers_per_unit` > 1 (the method between nodes, aggregation/placement/between_nodes.py): the
    attackers are `count` of the nodes, every tower of an attacking node alters its
    gradient alike (the same noise draw per node; alie and ipm over the honest nodes'
    means), so the node's mean is the attack's. `num_classes`: C of labelflip
    (byzantine.label_classes); `tower_devices`: where alie's and ipm's attack vectors go
    (None: left where they are formed, for tests)."""

    def __init__(self, attack: Attack, count: int, choice: str, seed: int, global_step,
                 first_tower: int, total_towers: int, host: str, towers_per_unit: int = 1,
                 num_classes: int | None = None, tower_devices=None):
        self.attack, self.count, self.random = attack, count, choice == "random"
        self.seed, self.global_step, self.host = seed, global_step, host
        self.first_tower, self.per_unit = first_tower, towers_per_unit
        self.total_units = total_towers // towers_per_unit
        self.num_classes, self.tower_devices = num_classes, tower_devices
        self.z = None
        if attack.name == "alie":
            self.z = attack.options["z"] or alie_z(self.total_units, count)
            if self.z == 0.0:  # e.g. n = 4, f = 1: (n - s) / n = 1/2
                logging.warning("--attack=alie: z_max = 0 for n=%d units and f=%d attackers: "
                                "every attacker sends the honest mean (give alie:z=Z)",
                                self.total_units, count)
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

    def _unit(self, t: int) -> int:
        return (self.first_tower + t) // self.per_unit

    def _choose(self, unit: int, altered, honest):
        """`altered` where the unit attacks this step, else `honest` (a tf.where if random)."""
        if not self.random:
            return altered if unit < self.count else honest
        return tf.where(self._flags[unit] > 0.5, tf.convert_to_tensor(altered),
                        tf.convert_to_tensor(honest))

    # --- per tower: g' from the tower's own gradient ---------------------------------------

    def unscale(self, t, grads):
        unit = self._unit(t)
        if self.attack.name not in PER_TOWER or (not self.random and unit >= self.count):
            return grads  # an honest tower, or another kind of attack: nothing traced
        return [g if g is None else self._choose(unit, self._alter(g, unit, i), g)
                for i, g in enumerate(grads)]

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

    def acts_in_tower_pass(self) -> bool:
        return self.attack.name == "labelflip"  # the others alter what the tower sends

    # --- labelflip: the labels the tower's loss reads --------------------------------------

    def labels(self, t, y, outputs):
        unit = self._unit(t)
        if self.attack.name != "labelflip" or (not self.random and unit >= self.count):
            return y
        if isinstance(y, padding.Weighted):  # a padded short batch: its labels, same weights
            return padding.Weighted(self.labels(t, y.labels, outputs), y.weights)
        return self._choose(unit, flip_labels(y, outputs, self.num_classes), y)

    # --- alie, ipm: every tower's gradients at once ----------------------------------------

    def alter_towers(self, grads):
        if self.attack.name not in OMNISCIENT:
            return grads
        sent = [list(tower) for tower in grads]
        for i in range(len(grads[0])):
            if grads[0][i] is None:
                continue
            # dense for every tower (IndexedSlices: as --sparse_as_dense), the attack is dense
            dense = [tf.convert_to_tensor(tower[i]) for tower in grads]
            with tf.device(self.host):
                attack = self.attack_vector(self._unit_means(dense))
            for t in range(len(grads)):
                with (tf.device(self.tower_devices[t]) if self.tower_devices
                      else contextlib.nullcontext()):
                    chosen = self._choose(self._unit(t), attack, dense[t])
                    sent[t][i] = tf.identity(chosen) if chosen is attack else chosen
        return sent

    def _unit_means(self, dense: list[tf.Tensor]) -> tf.Tensor:
        """[units here, ...]: each unit's gradient (a node's: the mean over its towers)."""
        p = self.per_unit
        if p == 1:
            return tf.stack(dense)
        return tf.stack([tf.add_n(dense[u:u + p]) / p for u in range(0, len(dense), p)])

    def attack_vector(self, units: tf.Tensor) -> tf.Tensor:
        """What every attacker sends, from the units' gradients `units` [n, ...] (n: every
        unit of the job, one worker's): over the n - f honest ones (this step's flags 0),
        mu = their mean, sigma = their standard deviation, per coordinate (population:
        divided by n - f; with alie's ddof=1 the sample one, by n - f - 1);
        alie: mu - z sigma; ipm: -epsilon mu."""
        shape = tf.concat([[self.total_units], tf.ones([tf.rank(units) - 1], tf.int32)], 0)
        attacker = tf.reshape(self._flags > 0.5, shape)
        honest_count = tf.cast(self.total_units - self.count, units.dtype)
        zeros = tf.zeros_like(units)
        mu = tf.reduce_sum(tf.where(attacker, zeros, units), 0) / honest_count
        if self.attack.name == "ipm":
            return -self.attack.options["epsilon"] * mu
        deviation = tf.where(attacker, zeros, units - mu)
        sigma = tf.sqrt(tf.reduce_sum(tf.square(deviation), 0)
                        / (honest_count - self.attack.options["ddof"]))
        return mu - self.z * sigma


def flip_labels(y, outputs, num_classes: int):
    """y' = C - 1 - y for class ids (int or float: a K = 1 model's {0, 1} labels give
    1 - y); one-hot (or soft) rows, as the cross-entropy reads them (losses.is_one_hot),
    reversed along the class axis: the same map, class k's mass moved to C - 1 - k."""
    y = tf.convert_to_tensor(y)
    if losses.is_one_hot(y, outputs):
        return tf.reverse(y, [-1])
    return tf.cast(num_classes - 1, y.dtype) - y
