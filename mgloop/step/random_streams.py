"""Per-tower random streams for the layers that draw random numbers (Dropout, GaussianNoise,
random augmentation layers).

A Keras 3 random layer owns a `keras.random.SeedGenerator`, whose state is a
non-trainable int64 variable s = [s0, c]: draw j of a forward pass uses the
stateless seed [s0, c + j] (Philox on CPU and GPU), and the pass returns the
state [s0, c + k] after its k draws. Every tower runs the template through
`stateless_call` with the state of the copy it reads, so without this module
every tower would draw exactly the same numbers (the same dropout mask rows).

Tower g (its GLOBAL index: worker index * towers per worker + local index)
computes with the state

    [a_g, c],  a_0 = s0,  a_g = U_int64(seed=[s0, 2^40 + g])  for g >= 1

where U_int64 is one full-range int64 from TensorFlow's stateless generator
(Philox, `tf.random.stateless_uniform`). Its draws therefore use the seeds
[a_g, c + j]. Why the streams are independent:

  * across towers: TensorFlow turns a seed pair into a Philox key and starting
    counter by one Philox block over the pair, a bijection, so distinct pairs
    start distinct streams, as unrelated as Philox outputs under different keys
    (the assumption every counter-based generator rests on, e.g. TensorFlow's
    own `stateless_fold_in` for replicas). The a_g are distinct unless two
    31-bit hashes collide (Keras reduces a seed modulo 2^31 - 2): probability
    about G^2 / 2^32 for G towers, the order of two Keras layers' random seeds
    colliding. Keras's own draws use seeds below 2^31, so the hash input
    [s0, 2^40 + g] is never a seed of a layer's draw (domain separation).
  * across steps: the counter c advances by k per step as on one device, so a
    tower never reuses a seed pair.
  * repeatable: a_g depends only on s0 and g, and s0 on the layer's seed (from
    `keras.utils.set_random_seed`, i.e. `--seed`): two runs with the same seed
    draw the same numbers on every tower, with or without `--deterministic`.

After the pass each tower's returned state has a_g replaced by s0 again, so
every tower returns [s0, c + k]: the state one device would hold after the same
step, which is what every variable copy takes (and what checkpoints hold).
Global tower 0 draws with the one device's own state; since Philox numbers each
element of a draw by its position, its first rows are the first rows of one
device's draw for the global batch. The other towers' rows are independent
draws, not the remaining rows of that draw (so a dropout model on T > 1 towers
is statistically, not numerically, the one-device run). Rows [t B/T, (t+1) B/T)
of that draw could be had by starting tower t's Philox counter t B/T x (row
size) / 4 blocks further, but only by replacing Keras's random ops while a tower
is traced, and only for draws whose leading axis is the batch and whose
sampler uses a fixed count of numbers per element (not truncated normal, not
per-batch augmentation parameters); that is not done.
"""

from __future__ import annotations

from typing import Sequence

import keras
import tensorflow as tf

# Added to the tower index in the hash's seed pair: above every seed Keras draws with.
_TOWER_DOMAIN = 1 << 40


def seed_state_indices(model: keras.Model) -> list[int]:
    """Positions in `model.non_trainable_variables` of its SeedGenerators' states."""
    states = [generator.state for layer in model._flatten_layers(include_self=True)
              for generator in getattr(layer, "_seed_generators", [])]
    return [i for i, variable in enumerate(model.non_trainable_variables)
            if any(variable is state for state in states)]


def tower_key(s0: tf.Tensor, tower: int) -> tf.Tensor:
    """a_g for global tower `tower` (see the module docstring); a_0 = s0."""
    if tower == 0:
        return s0
    seed = tf.stack([s0, tf.constant(_TOWER_DOMAIN + tower, s0.dtype)])
    return tf.random.stateless_uniform([], seed=seed, minval=None, maxval=None,
                                       dtype=s0.dtype)


class RandomStreams:
    """The seed states among a model's non-trainable values, given per tower.

    `first_tower`: the global index of this process's tower 0 (worker index *
    towers per worker), so that towers of different workers draw differently.
    """

    def __init__(self, model: keras.Model, first_tower: int = 0):
        self.indices = seed_state_indices(model)
        self.first_tower = first_tower

    def for_tower(self, state: Sequence[tf.Tensor], tower: int, device: str) -> list[tf.Tensor]:
        """Local tower `tower`'s non-trainable values with each seed state [s0, c] made
        [a_g, c] (computed on `device`, the tower's)."""
        state = list(state)
        global_tower = self.first_tower + tower
        if not self.indices or global_tower == 0:
            return state
        with tf.device(device):
            for i in self.indices:
                state[i] = tf.stack([tower_key(state[i][0], global_tower), state[i][1]])
        return state

    def after_tower(self, given: Sequence[tf.Tensor], returned: Sequence[tf.Tensor]
                    ) -> list[tf.Tensor]:
        """The state a tower returned, each seed state's key set back to the s0 of `given`
        (the values before `for_tower`): [s0, c + k], as one device's after the pass."""
        returned = list(returned)
        for i in self.indices:
            with tf.device(returned[i].device):
                returned[i] = tf.stack([given[i][0], returned[i][1]])
        return returned
