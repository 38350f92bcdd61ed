"""`--shard_update`: each copy updates only its chunk of the weights, with the optimizer
state of that chunk alone (ZeRO stage 1: Rajbhandari et al. 2020; PyTorch's
ZeroRedundancyOptimizer), for a method that splits its all-reduce (shard_exchange.py).

Copy 0's trainable variables form segments (`Layout`: a large variable alone, smaller
consecutive ones packed into one flat vector of up to --pack_bytes). The method cuts each
segment's flat vector into chunks; copy c owns chunk k = owned_shard(c) of every
segment, which meets some variables: its `Piece`s, each the entries [start, end) of one
variable. Per step and segment:

    1. the exchange (`exchange`): tower t flattens its gradients, the method's
       reduce-scatter leaves on copy c the mean of chunk k over the towers;
    2. copy c's optimizer applies each piece's part of that mean to the piece's variable
       (copy c's own copy of those weight entries, kept beside its whole copy);
    3. the method's all-gather brings every updated chunk to every copy, which writes
       them into its whole variables.

The optimizer must be element-wise (`check_optimizer`): an entry's update reads only that
entry's weight, gradient and state, so updating pieces gives the whole update's numbers
bit for bit (tests/test_sharded_update.py). Memory per copy: the optimizer state of its
chunk (1/T of it; with `hierarchical`, G/T) and the chunk's weights again (the variables
Keras's optimizers update), against the whole state on every copy without sharding.

The one thing those optimizers decide by a variable's name or identity is weight decay,
v <- v - lr wd v unless the variable is excluded (`exclude_from_weight_decay(var_list=...,
var_names=...)`: its id among var_list's, or a var_names pattern found in its name). A
piece is a new variable (`owned_{c}_{i}`) that neither list names, so each piece's
optimizer is told by identity alone what copy 0's whole optimizer decides for the piece's
whole variable (optim.decays, optim.build_optimizers): piece p of variable i is excluded exactly when
variable i is, whatever the pieces' names and however a chunk mixes variables. An
optimizer instance with a method replaced (its own `_use_weight_decay`, `update_step`,
...) may key on names no piece has, and is refused (`check_optimizer`).

A checkpoint holds copy 0's optimizer whole, as an unsharded run's: `whole_optimizer`
builds its state on the host for the save (every piece's slots gathered into it) or the
restore (scattered from it into the pieces on leaving), and drops it after
(whole_state.py), so a run resumes with another tower count, or without --shard_update,
and the reverse.
"""

from __future__ import annotations

import contextlib
import dataclasses

import keras
import tensorflow as tf

from mgloop.aggregation.kernels import packing
from mgloop.errors import ConfigError
from mgloop.step.hooks import Hook
from mgloop.step.whole_state import WholeState
from mgloop.training import optim
from mgloop.training.variables import VariableCopy, backing, copy_first_to_rest

# Keras's optimizers whose update of an entry reads only that entry (weight, gradient, slots)
ELEMENT_WISE = tuple(getattr(keras.optimizers, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Nadam", "Ftrl",
    "Lion"))


def check_optimizer(optimizer: keras.optimizers.Optimizer) -> None:
    """Refuses (one line) an optimizer whose update of an entry reads more than the entry:
    a norm over a whole variable or every gradient (clipnorm, global_clipnorm, LAMB's trust
    ratio), factored or matrix state (Adafactor, Muon), or a class it does not know; or
    one with a method replaced on the instance, which may key on a variable's name or
    identity where the pieces' own differ (the class's weight-decay exclusion is mapped
    onto the pieces: optim.decays)."""
    name = type(optimizer).__name__
    if type(optimizer) not in ELEMENT_WISE:
        raise ConfigError(
            f"--shard_update needs an element-wise optimizer, and {name} is not one mgloop "
            "knows to be (LAMB's trust ratio, Adafactor's factored moments and Muon's "
            "orthogonalised matrices read whole variables); use one of: "
            + ", ".join(cls.__name__ for cls in ELEMENT_WISE) + ", or no --shard_update")
    for setting in ("clipnorm", "global_clipnorm"):
        if getattr(optimizer, setting, None):
            raise ConfigError(f"--shard_update: the optimizer's {setting} reads the norm of "
                              "whole gradients, which no copy holds; clip by value "
                              f"(clipvalue) or leave out --shard_update")
    if optimizer.use_ema or (optimizer.gradient_accumulation_steps or 1) > 1:
        raise ConfigError("--shard_update: the optimizer's use_ema and "
                          "gradient_accumulation_steps keep state mgloop does not shard; "
                          "use --accumulation_steps, or leave out --shard_update")
    replaced = sorted(name for name, value in vars(optimizer).items()
                      if callable(value) and callable(getattr(type(optimizer), name, None)))
    if replaced:
        raise ConfigError(
            f"--shard_update: the optimizer's {', '.join(replaced)} (replaced on the "
            "instance) may read a variable's name or identity, which a copy's piece of the "
            f"variable does not share; use {name}'s own methods (exclusions through "
            "exclude_from_weight_decay), or leave out --shard_update")


def check_hooks(hooks) -> None:
    """Refuses (one line) a hook that reads the copies' gradients after the exchange (its
    `after_exchange`): with --shard_update a copy holds only its chunk of the mean."""
    for hook in hooks:
        if type(hook).after_exchange is not Hook.after_exchange:
            raise ConfigError(
                f"--shard_update: the hook {type(hook).__name__} reads the copies' gradients "
                "after the exchange (after_exchange), and each copy holds only its chunk of "
                "the mean; leave out --shard_update or the hook")


@dataclasses.dataclass(frozen=True)
class Piece:
    """Entries [start, end) of variable `variable`, at `offset` in its copy's chunk."""

    variable: int
    start: int
    end: int
    offset: int


class Layout:
    """Copy 0's trainable variables in segments (`segments`: variable indices, one dtype
    each: consecutive variables packed up to `bucket_bytes`, a larger one alone, as
    --pack_bytes packs; 0: each alone), each a flat vector the method splits; per copy and
    segment, the pieces of the chunk the copy owns. A variable alone is its own flat vector
    (a reshape: nothing copied), so large variables cost no concatenation."""

    def __init__(self, variables, method, num_copies: int, bucket_bytes: int = 0):
        self.shapes = [v.shape for v in variables]
        self.segments = (packing.plan(list(variables), bucket_bytes) if bucket_bytes
                         else [[i] for i in range(len(variables))])
        self.dtypes = [variables[segment[0]].dtype for segment in self.segments]
        self.pieces = [[self._pieces(method, segment, c) for segment in self.segments]
                       for c in range(num_copies)]

    def pieces_of(self, copy: int) -> list[Piece]:
        """Copy `copy`'s pieces of every segment, in order (its shard's variables' order)."""
        return [p for segment in self.pieces[copy] for p in segment]

    def _pieces(self, method, segment: list[int], copy: int) -> list[Piece]:
        sizes = [self.shapes[i].num_elements() for i in segment]
        first, last = method.shard_bounds(sum(sizes))[method.owned_shard(copy)]
        pieces, start = [], 0
        for i, size in zip(segment, sizes):
            lo, hi = max(first, start), min(last, start + size)
            if lo < hi:
                pieces.append(Piece(i, lo - start, hi - start, lo - first))
            start += size
        return pieces

    def flatten(self, values, segment: int) -> tf.Tensor:
        """The segment's values as one flat vector (on the current device)."""
        flats = [tf.reshape(tf.convert_to_tensor(values[i]), [-1])
                 for i in self.segments[segment]]
        return flats[0] if len(flats) == 1 else tf.concat(flats, axis=0)

    def unflatten(self, flat: tf.Tensor, segment: int) -> list[tf.Tensor]:
        """The segment's variables' values from its flat vector (on the current device)."""
        indices = self.segments[segment]
        if len(indices) == 1:
            return [tf.reshape(flat, self.shapes[indices[0]])]
        sizes = [self.shapes[i].num_elements() for i in indices]
        return [tf.reshape(part, self.shapes[i])
                for i, part in zip(indices, tf.split(flat, sizes))]


def slots_by_reference(optimizer) -> dict[int, list]:
    """id(variable) -> the optimizer's slots made from it, in the order made (recorded by
    optim.colocate_with_variables)."""
    return optimizer.mgloop_slots


class ShardedUpdate:
    """The pieces of every copy, their optimizers, the step's update and the checkpoint's
    whole optimizer, for `method` (a ShardsUpdate) on `copies`."""

    def __init__(self, method, copies: list[VariableCopy], optimizer_fn, bucket_bytes: int = 0):
        self.method, self.copies = method, copies
        self.layout = Layout(copies[0].trainable, method, len(copies), bucket_bytes)
        # per copy, per segment: its pieces' variables (the chunk it owns of its weights)
        self.owned = []
        for c, copy in enumerate(copies):
            with tf.device(copy.device):
                self.owned.append([[tf.Variable(self._sliced(copy, p),
                                                name=f"owned_{c}_{p.variable}")
                                    for p in segment] for segment in self.layout.pieces[c]])
        self.shards = [VariableCopy(copy.device, [v for segment in owned for v in segment], [])
                       for copy, owned in zip(copies, self.owned)]
        # each piece decays exactly when copy 0's whole optimizer decays its variable
        decayed = optim.decays(optimizer_fn(), copies[0].trainable)
        optim.build_optimizers(self.shards, optimizer_fn, [
            [decayed[p.variable] for p in self.layout.pieces_of(c)]
            for c in range(len(self.shards))])
        self.whole_state = WholeState(optimizer_fn, copies[0].trainable, method.devices.host)
        for copy, shard in zip(copies, self.shards):
            _check_slots(shard)
            copy.optimizer = shard.optimizer  # what the schedule's summaries read

    @staticmethod
    def _sliced(copy: VariableCopy, piece: Piece) -> tf.Tensor:
        return tf.reshape(copy.trainable[piece.variable], [-1])[piece.start:piece.end]

    def exchange(self, tower_grads, average: bool) -> list[list[tf.Tensor]]:
        """Per copy, per segment: its owned chunk of the mean over the towers."""
        per_segment = []
        for s in range(len(self.layout.segments)):
            flats = []
            for device, grads in zip(self.method.devices.towers, tower_grads):
                with tf.device(device):
                    flats.append(self.layout.flatten(grads, s))
            per_segment.append(self.method.reduce_scatter(flats, average))
        return [list(chunks) for chunks in zip(*per_segment)]

    def apply(self, chunks_per_copy, states_per_copy, may_apply) -> None:
        """Copy c's optimizer updates its pieces from its chunks (inside `may_apply(c, ...)`,
        with its non-trainable state), then every copy takes every updated chunk."""
        for c, (copy, shard) in enumerate(zip(self.copies, self.shards)):
            def update(c=c, copy=copy, shard=shard, states=states_per_copy[c]):
                grads = [chunk[p.offset:p.offset + p.end - p.start]
                         for chunk, pieces in zip(chunks_per_copy[c], self.layout.pieces[c])
                         for p in pieces]
                if grads:
                    optim.apply_updates([shard], [grads])
                for var, value in zip(copy.non_trainable, states):
                    with tf.device(var.device):
                        var.assign(value)
            may_apply(c, update)
        for s, dtype in enumerate(self.layout.dtypes):
            chunks = []
            for shard, owned in zip(self.shards, self.owned):
                with tf.device(shard.device):
                    values = [v.read_value() for v in owned[s]]
                    chunks.append(values[0] if len(values) == 1 else
                                  tf.concat(values, 0) if values else tf.zeros([0], dtype))
            for copy, flat in zip(self.copies, self.method.all_gather(chunks)):
                with tf.device(copy.device):  # (a value made here is taken, not copied)
                    for i, value in zip(self.layout.segments[s],
                                        self.layout.unflatten(flat, s)):
                        copy.trainable[i].assign(value)

    def sync(self) -> None:
        """After a restore into copy 0: every copy's weights from copy 0 and every piece
        from its copy (the slots came from the checkpoint's whole optimizer)."""
        copy_first_to_rest(self.copies, slots=False)
        for c, (copy, shard) in enumerate(zip(self.copies, self.shards)):
            for variable, piece in zip(shard.trainable, self.layout.pieces_of(c)):
                variable.assign(self._sliced(copy, piece))

    @property
    def optimizer_variables(self) -> list:
        """Every piece's optimizer state (the chief's broadcast; the finite check)."""
        return [backing(v) for shard in self.shards for v in shard.optimizer.variables]

    def owned_weight_bytes(self) -> dict[str, int]:
        """Per device: the bytes of the weight entries its copy holds again to update them."""
        return {shard.device: sum(v.shape.num_elements() * v.dtype.size
                                  for v in shard.trainable) for shard in self.shards}

    @contextlib.contextmanager
    def whole_optimizer(self, restoring: bool):
        """Copy 0's optimizer whole, on the host, for one save or restore (whole_state.py):
        gathered from the pieces' optimizers first (saving), or scattered into them on
        leaving (restoring)."""
        holder, slots, others = self.whole_state.holder()
        if not restoring:
            self._gather_into(slots, others)
        yield holder
        if restoring:
            self._scatter_from(slots, others)

    def _slot_lists(self, optimizer, variables) -> tuple[list, list[list]]:
        """(the optimizer's variables made from no reference, each variable's slots)."""
        table = slots_by_reference(optimizer)
        slots = [table.get(id(v), []) for v in variables]
        made = {id(s) for group in slots for s in group}
        return [v for v in optimizer.variables if id(v) not in made], slots

    def _owners(self):
        """(copy, its piece's index in its shard, piece) covering each variable's entries
        once, in order (with `hierarchical`, a chunk's first holder)."""
        seen, out = set(), []
        for c in range(len(self.copies)):
            for k, p in enumerate(self.layout.pieces_of(c)):
                if (p.variable, p.start) not in seen:
                    seen.add((p.variable, p.start))
                    out.append((c, k, p))
        return sorted(out, key=lambda owner: (owner[2].variable, owner[2].start))

    def _gather_into(self, slots: dict, others: list) -> None:
        first_others, _ = self._slot_lists(self.shards[0].optimizer, self.shards[0].trainable)
        for target, source in zip(others, first_others, strict=True):
            target.assign(backing(source).read_value())
        shard_slots = [self._slot_lists(shard.optimizer, shard.trainable)[1]
                       for shard in self.shards]
        parts = {}  # (variable, slot kind) -> its pieces' values in order
        for c, k, piece in self._owners():
            for kind, slot in enumerate(shard_slots[c][k]):
                parts.setdefault((piece.variable, kind), []).append(backing(slot).read_value())
        for key, slot in slots.items():
            slot.assign(tf.reshape(tf.concat(parts[key], 0), slot.shape))

    def _scatter_from(self, slots: dict, others: list) -> None:
        for c, shard in enumerate(self.shards):
            shard_others, shard_slots = self._slot_lists(shard.optimizer, shard.trainable)
            for target, source in zip(shard_others, others, strict=True):
                backing(target).assign(source.read_value())
            for piece, kinds in zip(self.layout.pieces_of(c), shard_slots):
                for kind, slot in enumerate(kinds):
                    flat = tf.reshape(slots[(piece.variable, kind)].read_value(), [-1])
                    backing(slot).assign(flat[piece.start:piece.end])


def _check_slots(shard: VariableCopy) -> None:
    """Refuses (one line) an optimizer that made a slot of another shape than its variable's
    (not element-wise, whatever its class)."""
    table = slots_by_reference(shard.optimizer)
    for variable in shard.trainable:
        for slot in table.get(id(variable), []):
            if tuple(slot.shape) != tuple(variable.shape):
                raise ConfigError(
                    f"--shard_update: the optimizer made a slot of shape {slot.shape} for a "
                    f"variable of shape {variable.shape}, so its update is not element-wise; "
                    "use an element-wise optimizer (SGD, Adam, ...) or no --shard_update")
