"""How global batches reach the towers: `--staging` none | host | device, depth K.

Every mode hands step t the same shards: global batch t of the input, split
into T contiguous shards of B/T examples, tower 0 first, shard i on tower i's
device (batch_split.py). The modes differ only in what overlaps the towers' compute:

    none    nothing. Step t asks the host for batch t once step t-1 has finished;
            the host makes it (tf.data with no prefetch, no autotuning and no
            default optimizations, so tf.data adds no background thread of its
            own), splits it and copies the shards; then the towers compute. The
            Keras-style synchronous feed.
    host    tf.data prefetch of K global batches: a host thread makes batches
            t+1..t+K while the towers compute step t. The split and the copies
            to the towers still happen inside step t.
    device  host prefetch as above, plus a staging area of K shards on every
            tower's device (TensorFlow's Stage/Unstage ops, the ones behind the
            TF1 StagingArea). `prime` stages K batches before the first step; step
            t unstages shard t on every tower and stages the shards of batch t+K
            (`refill`), which runs concurrently with step t's compute, so the
            copy of batch t+K overlaps it.

Staged batches belong to the iterator that filled them. When it ends, steps go
on unstaging until the areas are empty (drain), so no batch is lost,
duplicated or reordered; `clear` empties the areas when an iterator is
abandoned (the Trainer does so when it is given another iterator and at the
end of every `fit`). `clock()` is the in-graph timer the Trainer measures
input wait with (loop.py).
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

import tensorflow as tf

from mgloop.data.batch_split import Shards, nested_split, split_to_towers
from mgloop.settings import choice, in_range

try:  # not in TensorFlow's public API; without it, always use the Python clock
    from tensorflow.python.framework.config import is_op_determinism_enabled
except ImportError:  # pragma: no cover
    def is_op_determinism_enabled() -> bool:
        return True

from mgloop.data.options import DataOptions
from mgloop.data.options import STAGING_MODES as MODES


def check_staging(options: DataOptions) -> None:
    """--staging names a mode; --staging_depth >= 1."""
    choice("staging", options.staging, MODES)
    in_range("staging_depth", options.staging_depth, low=1)


Take = Callable[[], tuple[Shards, list]]  # -> (shards, ops the step's end must wait for)


def clock() -> tf.Tensor:
    """Seconds now (float64 scalar), read when the op runs inside a compiled loop.

    `tf.timestamp`, except under op determinism, which refuses it: then a
    `tf.py_function` reading Python's `time.perf_counter` (a little slower).
    """
    if is_op_determinism_enabled():
        now = tf.py_function(time.perf_counter, [], tf.float64)
        now.set_shape([])
        return now
    return tf.timestamp()


def synchronous(batches: tf.data.Dataset) -> tf.data.Dataset:
    """`batches` with every asynchronous stage that tf.data would add by itself turned off.

    Without this, tf.data's default optimizations (e.g. map-and-batch fusion)
    and injected prefetching compute batches ahead on background threads.
    Explicit asynchronous stages of `batches` itself are kept.
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    options.experimental_warm_start = False
    optimization = options.experimental_optimization
    optimization.apply_default_optimizations = False
    optimization.inject_prefetch = False
    optimization.map_parallelization = False
    optimization.parallel_batch = False
    optimization.seq_interleave_prefetch = False
    return batches.with_options(options)


class HostStaging:
    """`none` (depth 0: synchronous) and `host` (tf.data prefetch of `depth` batches)."""

    # whether `may_have_batch` knows if a batch is left without taking it (the compiled loop
    # then has no `break`, so no conditional around the step: runs/loop.py)
    knows_ahead = False

    def __init__(self, mode: str, depth: int, devices: list[str], micro_batches: int = 1):
        self.mode, self.depth, self.devices = mode, depth, list(devices)
        self.micro_batches = micro_batches  # --accumulation_steps: batches per step

    def pipeline(self, batches: tf.data.Dataset) -> tf.data.Dataset:
        """The host side of the mode, applied to a dataset of global batches (x, y)."""
        if self.mode == "none":
            return synchronous(batches)
        return batches.prefetch(self.depth)

    @property
    def staged(self) -> int:
        """Batches held on the towers (none here)."""
        return 0

    def prime(self, iterator) -> None:
        """Nothing is staged ahead on the towers."""

    def clear(self) -> None:
        """Nothing to clear (a host prefetch buffer goes with its iterator)."""

    def may_have_batch(self, after: tf.Tensor | None = None) -> tf.Tensor:
        """In a compiled loop, the loop's condition: False once it is known that no batch is
        left. Here always True, as the host cannot know without taking the next batch
        (`next_batch` does, and tells)."""
        return tf.constant(True)

    def next_batch(self, iterator, after: tf.Tensor) -> tuple[tf.Tensor, Take]:
        """In a compiled loop: (has a batch?, take) once `after` has run.

        `take()` (call it only if there is a batch) returns the shards on the
        towers and the ops the step must wait for besides its compute (none).
        """
        with tf.control_dependencies([after]):
            optional = iterator.get_next_as_optional()

        def take():
            x, y = optional.get_value()
            return split_to_towers(x, y, self.devices, self.micro_batches), []
        return optional.has_value(), take


class DeviceStaging(HostStaging):
    """`device`: host prefetch plus a staging area of `depth` shards on every tower."""

    knows_ahead = True  # from its count

    _ids = itertools.count()

    def __init__(self, mode: str, depth: int, devices: list[str], micro_batches: int = 1):
        super().__init__(mode, depth, devices, micro_batches)
        uid = next(self._ids)
        self._names = [f"mgloop_staging_{uid}_tower_{t}" for t in range(len(self.devices))]
        self._spec = None  # element spec (x, y) of the global batches, set by prime
        with tf.device("/device:CPU:0"):
            # Batches held in every area (they fill and drain together).
            self._count = tf.Variable(0, dtype=tf.int64, trainable=False,
                                      name=f"mgloop_staged_{uid}")

    def pipeline(self, batches: tf.data.Dataset) -> tf.data.Dataset:
        return batches.prefetch(self.depth)

    @property
    def staged(self) -> int:
        return int(self._count.numpy())

    def prime(self, iterator) -> None:
        """Stages batches until every area holds `depth` of them or the input ends."""
        self._set_spec(iterator.element_spec)
        for _ in range(self.depth - self.staged):
            if not bool(self.refill(iterator)):
                break

    def clear(self) -> None:
        """Empties every area (the staged batches are dropped)."""
        if self._spec is None:
            return
        for device, name in zip(self.devices, self._names):
            with tf.device(device):
                tf.raw_ops.StageClear(dtypes=self._dtypes(), shared_name=name)
        self._count.assign(0)

    @tf.function(autograph=False)  # its conditional is a tf.cond (loop.py's top)
    def refill(self, iterator) -> tf.Tensor:
        """Stages the shards of the iterator's next batch; returns whether there was one."""
        optional = iterator.get_next_as_optional()

        def stage():
            parts = nested_split(optional.get_value(), len(self.devices), self.micro_batches)
            puts = []
            for device, name, part in zip(self.devices, self._names, parts):
                with tf.device(device):
                    puts.append(tf.raw_ops.Stage(values=tf.nest.flatten(part),
                                                 shared_name=name))
            with tf.control_dependencies(puts):
                counted = self._count.assign_add(1)
            with tf.control_dependencies([counted]):
                return tf.identity(tf.constant(True))
        return tf.cond(optional.has_value(), stage, lambda: tf.constant(False))

    def may_have_batch(self, after: tf.Tensor | None = None) -> tf.Tensor:
        """Whether a batch is staged, read once `after` has run (after the step that took the
        last batch and staged the next): the areas are known ahead, so the loop tests this
        in its condition and `next_batch` says True as a Python bool. A tensor test there
        would put the whole step inside a conditional, with a switch on every tower for
        every tensor the step takes in (docs/results/towers.md)."""
        with tf.control_dependencies([] if after is None else [after]):
            return self._count.value() > 0

    def next_batch(self, iterator, after: tf.Tensor) -> tuple[bool, Take]:
        """(True, take): called only when `may_have_batch` said so. The ops `take()` returns
        for the step's end to wait for are the staging of batch t+K and the count's update,
        so that `may_have_batch(after=the step's end)` reads the count they leave."""
        def take():
            shards = []
            with tf.control_dependencies([after]):
                for device, name in zip(self.devices, self._names):
                    with tf.device(device):
                        leaves = tf.raw_ops.Unstage(dtypes=self._dtypes(), shared_name=name)
                    for leaf, shape in zip(leaves, self._shard_shapes()):
                        leaf.set_shape(shape)
                    shards.append(tf.nest.pack_sequence_as(self._spec, leaves))
            with tf.control_dependencies(tf.nest.flatten(shards)):
                taken = self._count.assign_sub(1)
            with tf.control_dependencies([taken]):  # the count goes down, then up
                refilled = self.refill(iterator)  # batch t+K, concurrent with step t's compute
            return shards, [refilled.op]
        return True, take

    def _set_spec(self, spec) -> None:
        batch = tf.nest.flatten(spec)[0].shape[0]
        if batch is not None and batch % len(self.devices):
            raise ValueError(f"a global batch of {batch} examples does not split into "
                             f"{len(self.devices)} equal tower shards")
        if self._spec is not None and self._spec != spec:
            self.clear()  # batches of another shape cannot share the areas
        self._spec = spec

    def _dtypes(self) -> list[tf.DType]:
        return [s.dtype for s in tf.nest.flatten(self._spec)]

    def _shard_shapes(self) -> list[tf.TensorShape]:
        """The shape of every leaf of one tower's shard, in `tf.nest.flatten` order."""
        towers = len(self.devices)

        def shard(shape):
            batch = shape[0]
            return tf.TensorShape([None if batch is None else batch // towers]).concatenate(
                shape[1:])
        return [shard(s.shape) for s in tf.nest.flatten(self._spec)]


class PerDevice:
    """Towers sharing a device (--towers_per_device=K): `inner` stages one part per device,
    and each device's part is split into its K towers' shards there, after it arrives.
    Device d's part (`tower_split` over the D devices) holds, for every micro-batch, the
    rows of its towers d K .. d K + K - 1, so `tower_split` of it over K gives tower
    d K + j exactly the shard `tower_split` over the T towers gives it."""

    def __init__(self, inner: HostStaging, towers_per_device: int):
        self.inner, self.k = inner, towers_per_device

    def __getattr__(self, name):  # pipeline, staged, prime, clear, depth, mode, ...
        return getattr(self.inner, name)

    def next_batch(self, iterator, after: tf.Tensor) -> tuple[tf.Tensor | bool, Take]:
        has_batch, take_parts = self.inner.next_batch(iterator, after)

        def take():
            parts, waits = take_parts()
            shards = []
            for device, part in zip(self.inner.devices, parts):
                with tf.device(device):
                    shards += nested_split(part, self.k, self.inner.micro_batches)
            return shards, waits
        return has_batch, take


def make(mode: str, depth: int, devices, micro_batches: int = 1) -> HostStaging:
    """The staging of `mode` (one of MODES) with depth K = `depth` for the tower `devices`;
    `micro_batches` global batches make one step (--accumulation_steps). Towers listed on
    one device several times in a row are staged once per device (`PerDevice`)."""
    if mode not in MODES:
        raise ValueError(f"staging mode {mode!r} is not one of {MODES}")
    if depth < 1:
        raise ValueError(f"staging depth {depth} must be >= 1")
    cls = DeviceStaging if mode == "device" else HostStaging
    distinct = list(dict.fromkeys(devices))
    if len(distinct) < len(devices):
        return PerDevice(cls(mode, depth, distinct, micro_batches), len(devices) // len(distinct))
    return cls(mode, depth, list(devices), micro_batches)
