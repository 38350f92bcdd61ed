"""Where one compression happens and what it made: a `Site` (tower t, variable v, its
device, shape, seeds and state) and an `Encoded` variable (every tower's payload p_t, its
dense stand-in c_t and the packed tensors that travel), as compression/base.py's
`Compressed.encode` forms them.

Seeds are made lazily on the site's device at their first read (`seeds`: () ->
(shared_seed, tower_seed), base.py's `site`): most methods draw nothing, so most sites
trace no seed ops.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf


@dataclasses.dataclass
class Encoded:
    """One variable's compression on every tower (`Compressed.encode`), per tower t."""

    sites: list
    payloads: list
    sent: list  # c_t, the dense tensor p_t stands for
    wires: list  # the packed tensors that travel


@dataclasses.dataclass
class Site:
    """Where one compression happens: tower `tower` (device `device`), variable `index`."""

    tower: int
    index: int
    device: str
    shape: tf.TensorShape  # the variable's shape; the method works on x flattened
    dtype: tf.DType
    # () -> (shared_seed, tower_seed), made on the site's device at the first read of either
    # (most methods draw nothing: a dozen ops per tower and variable not traced)
    seeds: object
    state: dict  # name -> this tower's tf.Variable of `extra_state` for this variable
    notes: dict = dataclasses.field(default_factory=dict)  # a method's scratch within a step
    agreed: object = None  # what `agree` gave this tower (e.g. a scale shared by the towers)
    _seeds: tuple | None = dataclasses.field(default=None, repr=False)

    @property
    def size(self) -> int:
        return self.shape.num_elements()

    @property
    def shared_seed(self) -> tf.Tensor:
        """[2] int64: the same on every tower this step, for variable `index`."""
        return self._made_seeds()[0]

    @property
    def tower_seed(self) -> tf.Tensor:
        """[2] int64: this tower's own stream this step, for variable `index`."""
        return self._made_seeds()[1]

    def _made_seeds(self) -> tuple:
        graph = tf.compat.v1.get_default_graph()  # (a first read inside a branch's graph is
        if self._seeds is None or self._seeds[0] is not graph:  # not reused outside it)
            with tf.device(self.device):
                self._seeds = (graph, self.seeds())
        return self._seeds[1]
