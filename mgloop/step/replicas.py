"""The variable copies with their optimizers: what the towers read and every copy updates.

Copy 0 is the template model's own variables; a replicated layout adds one copy per
further tower (training/variables.py: make_copies). Each copy has its own optimizer (optim.py). The
`Replicas` read the values a tower computes with (`read_for_tower`), apply one step's
gradients and non-trainable state on every copy (`apply`), advance the global step,
and keep the copies equal after a restore (`sync_replicas`) or across workers
(`broadcast_from_chief`, which also carries the aggregation method's own state).
The method builds that state once the copies exist (`Aggregation.build(copy 0's
trainable variables)`), before any restore. How the copies update is the replicas'
`update`: `WholeUpdate` (every copy applies the whole mean with its whole optimizer), or
with --shard_update a `sharded_update.ShardedUpdate` (each copy its chunk).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

from mgloop.aggregation import REPLICATED, Aggregation
from mgloop.step import per_tower
from mgloop.step.hooks import Guard
from mgloop.training import optim
from mgloop.training import variables as variables_lib
from mgloop.training.variables import global_step_on  # noqa: F401 (the makers': made first)


class WholeUpdate:
    """Every copy applies the whole mean with its own optimizer, which holds the state of
    every entry; a checkpoint holds copy 0's as it is."""

    def __init__(self, method: Aggregation, copies: list[variables_lib.VariableCopy],
                 optimizer_fn: Callable[[], keras.optimizers.Optimizer]):
        del method  # (a sharded update's method splits it; here the exchange is whole)
        self.copies = copies
        optim.build_optimizers(copies, optimizer_fn)

    def apply(self, grads_per_copy, states_per_copy, may_apply: Guard) -> None:
        for c, copy in enumerate(self.copies):
            def update(copy=copy, grads=grads_per_copy[c], states=states_per_copy[c]):
                optim.apply_updates([copy], [grads])
                for var, value in zip(copy.non_trainable, states):
                    with tf.device(var.device):
                        var.assign(value)
            may_apply(c, update)

    def sync(self) -> None:
        variables_lib.copy_first_to_rest(self.copies)

    @property
    def optimizer_variables(self) -> list:
        """What the chief's broadcast carries of the optimizers: copy 0's (`sync` copies it)."""
        return [variables_lib.backing(v) for v in self.copies[0].optimizer.variables]

    @contextlib.contextmanager
    def whole_optimizer(self, restoring: bool):
        """Copy 0's optimizer, whole already, for a checkpoint."""
        del restoring
        yield self.copies[0].optimizer

    def owned_weight_bytes(self) -> dict[str, int]:
        return {}  # no weight entry is held twice


class Replicas:
    """The copies of `model`'s variables for `aggregation`, their optimizers, the step (the
    method's `step_counter`, made with it: `global_step_on`). `update(aggregation, copies,
    optimizer_fn)` makes how they update (default `WholeUpdate`)."""

    def __init__(self, model: keras.Model, aggregation: Aggregation,
                 optimizer_fn: Callable[[], keras.optimizers.Optimizer],
                 update: Callable = WholeUpdate):
        self.model = model
        self.aggregation = aggregation
        self.tower_devices = list(aggregation.devices.towers)
        # K: towers d K .. d K + K - 1 share device d (--towers_per_device)
        self.towers_per_device = aggregation.devices.towers_per_device
        self.copies = variables_lib.make_copies(model, aggregation.parameter_devices())
        self.update = update(aggregation, self.copies, optimizer_fn)
        # the counter the method was made with (or made itself), which it reads
        self.global_step = aggregation.step_counter
        aggregation.build(self.copies[0].trainable)

    @property
    def num_towers(self) -> int:
        return len(self.tower_devices)

    @property
    def workers(self):
        """The cluster of a cross-worker aggregation (placement/cross_worker.py), else None."""
        return self.aggregation.cluster

    @property
    def num_workers(self) -> int:
        return self.workers.num_workers if self.workers is not None else 1

    def copy_index(self, tower: int) -> int:
        """Replicated: the copy of the tower's device (one per device; with
        --towers_per_device=K, towers d K .. d K + K - 1 read copy d). Shared: copy 0."""
        if self.aggregation.capabilities.layout != REPLICATED:
            return 0
        return tower * len(self.copies) // self.num_towers

    def copy_for_tower(self, tower: int) -> variables_lib.VariableCopy:
        return self.copies[self.copy_index(tower)]

    def read_for_tower(self, tower: int, read=None) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        """The (trainable, non-trainable) values tower `tower` computes with, on its device.

        Replicated: its own copy, already there. Shared: copy 0, sent from each
        variable's device (the parameter reads, counted in the traffic). `read`: the copy's
        values already read in this step (`read_copy`), else read here.
        """
        device = self.tower_devices[tower]
        copy = self.copy_for_tower(tower)
        trainable, non_trainable = read if read is not None else self.read_copy(copy)
        values = (self.aggregation.tower_values(tower, trainable), non_trainable)
        if self.aggregation.capabilities.layout == REPLICATED:
            return values
        variables = copy.trainable, copy.non_trainable
        return tuple([self.aggregation.send(value, v.device, device) for value, v in zip(vals, vs)]
                     for vals, vs in zip(values, variables))

    @staticmethod
    def read_copy(copy: variables_lib.VariableCopy) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        """The copy's (trainable, non-trainable) values, read on their own devices."""
        return per_tower.read(copy.trainable), per_tower.read(copy.non_trainable)

    def read_for_towers(self, groups: list[range]) -> list[tuple[list, list]]:
        """`read_for_tower` of every tower: each copy read once in the step (the towers of
        a shared layout all read copy 0; nothing writes it before they have), then sent
        once per group of towers on one device (they read the same copy there: validation
        refuses methods whose `tower_values` differ per tower with --towers_per_device > 1)."""
        read = {}
        reads = []
        for group in groups:
            index = self.copy_index(group[0])
            if index not in read:
                read[index] = self.read_copy(self.copies[index])
            reads += [self.read_for_tower(group[0], read[index])] * len(group)
        return reads

    def apply(self, grads_per_copy, states_per_copy, may_apply: Guard) -> None:
        """Each copy applies its gradients (with --shard_update, its chunk's) and takes its
        new non-trainable state, inside `may_apply(copy index, update)` (hooks/__init__.py: e.g. only
        if every tower was finite): the replicas' `update`."""
        self.update.apply(grads_per_copy, states_per_copy, may_apply)

    def advance(self, also: list = ()) -> tf.Operation:
        """Counts the step; returns an op that has run once every copy holds its update
        (reads are ordered after the writes: automatic control dependencies) and `also`."""
        with tf.device(self.aggregation.devices.host):
            self.global_step.assign_add(1)
        return tf.group([v.value() for copy in self.copies for v in copy.variables]
                        + [self.global_step.value()] + list(also))

    def sync_replicas(self) -> None:
        """Copies variable copy 0 (e.g. just restored) into every other copy."""
        self.update.sync()

    def optimizer_bytes(self) -> dict[str, dict[str, int]]:
        """Per device: the bytes of its copy's optimizer state (`state`) and of the weight
        entries it holds again to update them (`owned_weights`, --shard_update)."""
        state = {}
        for copy in self.copies:
            state[copy.device] = state.get(copy.device, 0) + sum(
                int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in copy.optimizer.variables)
        return {"state": state, "owned_weights": self.update.owned_weight_bytes()}

    @property
    def checkpointed_copies(self) -> list[variables_lib.VariableCopy]:
        """The copies besides copy 0 a checkpoint must hold: every one when the method's
        copies differ between its synchronisations (`copies_differ`: local SGD), else none."""
        return self.copies[1:] if self.aggregation.capabilities.copies_differ else []

    def broadcast_from_chief(self, keep=()) -> None:
        """Several processes: every worker takes worker 0's variables, optimizer state (with
        --shard_update every copy's chunk of it: copy c of every worker holds the same chunk),
        step and aggregation state, then copies them into its replicas (run at start,
        after any restore); but for `keep`, the variables only this worker's node holds
        (node_checkpoint.py: just restored from its own checkpoint)."""
        if self.workers is None:
            return
        first = self.copies[0]
        kept = {id(v) for v in keep}
        variables = [v for v in (first.variables + self.update.optimizer_variables
                                 + [self.global_step] + list(self.aggregation.state_variables))
                     if id(v) not in kept]
        tf.function(lambda: self.aggregation.broadcast_from_chief(variables),
                    autograph=False)()  # as the step (runs/loop.py)
        if not kept:  # (kept copies were restored one by one)
            self.sync_replicas()
