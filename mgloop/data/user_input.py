"""`as_input`: what a user gives as training or eval data, turned into the run's input.

Accepted (anything else is one ConfigError line naming what was given):

    None                       --dataset (an in-memory dataset, or one a --plugin registered)
    InMemoryDataset            as --dataset's: a seeded permutation per epoch (epochs.py)
    tf.data.Dataset            elements (features, labels), each nested (a tensor, tuple, dict)
    Batched(ds) / Examples(ds) the same, saying whether the elements are batches or examples
    f(input_context)           -> tf.data.Dataset of THIS worker's data (tf.distribute's
                               InputContext(num_workers, worker_index, total towers)),
                               called after the seeds are set
    (x, y) arrays              numpy arrays or tensors, nested (dicts, tuples) with one leading
                               example dimension: a seeded permutation per epoch

How the global batch of B = --global_batch_size examples is formed (one step reads
K = --accumulation_steps of them, concatenated):

    examples     consecutive examples of a pass over the data, B at a time;
    batches      the batches are re-cut into B consecutive examples (tf.data `rebatch`):
                 the user's batch boundaries are not kept, only the example order;
    arrays       B consecutive examples of the epoch's permutation argsort(uniform(seed, e)).

A tf.data.Dataset is taken as examples when an element has a scalar leaf or leaves of
different static leading sizes, as batches when every leaf's leading size is unknown
(what `.batch(n)` gives); otherwise it is refused unless wrapped in Batched/Examples
(a leading size that is the same static n everywhere could be either), except when
TensorFlow's own batch-size inference finds a batch op of exactly n in the pipeline.

Every pass over the data ends in a short batch of N mod B examples (if not 0).
--drop_remainder=true (default) drops it; false trains it exactly (padding.py:
padded to B, weighted so that the step's loss is the mean over its real examples).
The data is repeated pass after pass until --train_steps (a finite pipeline is
re-iterated: reshuffle it yourself if you want new orders; a seeded shuffle is
reproducible).

Several workers: a dataset or arrays are read whole by every worker, which keeps
its contiguous B/W slice of each global batch (staging.worker_part); a function
gets the worker's InputContext and returns that worker's own data, cut into
batches of B/W (the global batch is the workers' batches, worker 0 first); its
short batches can only be dropped (the padding weights need the global count).

Resume: the input position is the global step, which the checkpoint holds. Step s
reads global batches s*K .. s*K+K-1 of the stream (`skip`), so a resumed run reads
what an uninterrupted one reads, provided the pipeline is deterministic (seeded
shuffles, no `deterministic=False`). tf.data's `skip` runs the pipeline over the
skipped elements: resuming costs reading the data up to the position once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import numpy as np
import tensorflow as tf

from mgloop import staging
from mgloop.data import epochs
from mgloop.data import padding
from mgloop.data.base import InMemoryDataset
from mgloop.errors import ConfigError

ACCEPTED = ("a tf.data.Dataset of (features, labels), a function input_context -> Dataset, "
            "numpy arrays (x, y) (x and y may be dicts or tuples of arrays), or a "
            "mgloop.data.InMemoryDataset")


@dataclasses.dataclass(frozen=True)
class Batched:
    """A tf.data.Dataset whose elements are batches (features [b, ...], labels [b, ...])."""
    dataset: tf.data.Dataset


@dataclasses.dataclass(frozen=True)
class Examples:
    """A tf.data.Dataset whose elements are single examples (features, labels)."""
    dataset: tf.data.Dataset


def _leading(spec) -> list:
    return [s.shape[0] if s.shape.rank else "scalar" for s in tf.nest.flatten(spec)]


def _describe(obj) -> str:
    text = repr(obj).replace("\n", " ")
    return f"{type(obj).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


class Input:
    """The run's input: `train_batches(start_step)` and `eval_batches()` (see the module)."""

    description: str = ""
    features_spec = None  # nested tf.TensorSpec of one example's features
    labels_spec = None
    num_classes: int | None = None
    has_eval_split: bool = False
    pads: bool = False  # short batches padded (padding.py)

    @property
    def input_shape(self) -> tuple | None:
        """One example's feature shape when the features are one tensor, else None."""
        if isinstance(self.features_spec, tf.TensorSpec):
            return tuple(self.features_spec.shape)
        return None

    def check_model(self, model) -> None:
        """Refuses a model the input cannot train exactly (padding with batch norm)."""
        if self.pads:
            padding.check_model(model)

    def train_batches(self, start_step: int) -> tf.data.Dataset:
        raise NotImplementedError

    def eval_batches(self) -> tf.data.Dataset:
        raise NotImplementedError


def _slice_for_worker(batches: tf.data.Dataset, config, workers) -> tf.data.Dataset:
    if workers is None or workers.num_workers == 1:
        return batches
    part = functools.partial(staging.worker_part, workers=workers.num_workers,
                             index=workers.index, micro_batches=config.accumulation_steps)
    return batches.map(lambda x, y: tf.nest.map_structure(part, (x, y)))


def _concat_steps(batches: tf.data.Dataset, steps: int) -> tf.data.Dataset:
    """K consecutive global batches -> one step of K*B examples (every leaf alike)."""
    if steps == 1:
        return batches
    merge = lambda leaf: tf.reshape(leaf, [-1, *leaf.shape[2:]])  # noqa: E731
    return batches.batch(steps, drop_remainder=True).map(
        lambda *parts: tf.nest.map_structure(merge, parts))


class InMemoryInput(Input):
    """An InMemoryDataset (today's datasets): the (seed, step) stream of epochs.py."""

    has_eval_split = True

    def __init__(self, dataset: InMemoryDataset, config, workers):
        epochs.check_fits(dataset, config.global_batch_size, config.drop_remainder)
        if len(dataset.eval_y) == 0:
            raise ConfigError(f"--dataset={dataset.name} has no eval examples, but every run "
                              "evaluates after training (and every --eval_every steps); give "
                              "the dataset at least one eval example")
        self.dataset, self.config, self.workers = dataset, config, workers
        self.description = f"--dataset={dataset.name}" if dataset.name else "an InMemoryDataset"
        self.features_spec = tf.TensorSpec(dataset.input_shape, tf.float32)
        self.labels_spec = tf.TensorSpec(dataset.train_y.shape[1:], tf.as_dtype(
            dataset.train_y.dtype))
        self.num_classes = dataset.num_classes

    def train_batches(self, start_step: int) -> tf.data.Dataset:
        c = self.config
        batches = epochs.step_batches(self.dataset, c.global_batch_size, c.accumulation_steps,
                                      c.seed, start_step, c.drop_remainder)
        return _slice_for_worker(batches, c, self.workers)

    def eval_batches(self) -> tf.data.Dataset:
        return self.dataset.eval_batches(self.config.global_batch_size)


class StreamInput(Input):
    """A user's data: `one_pass(epoch, context)` gives one pass over it (examples or batches).

    `per_worker`: the pass is this worker's data (a function of the InputContext), cut into
    batches of B/W; else every worker reads the whole pass and keeps its slice."""

    def __init__(self, description: str, one_pass, batched: bool, spec, config, workers,
                 per_worker: bool = False, eval_pass=None):
        self.description, self.one_pass, self.batched = description, one_pass, batched
        self.config, self.workers, self.per_worker = config, workers, per_worker
        self.eval_pass = eval_pass or (lambda: one_pass(None, _context(None, config)))
        self.features_spec, self.labels_spec = _example_spec(spec, batched)
        self.pads = not config.drop_remainder
        num_workers = workers.num_workers if workers is not None else 1
        if self.pads and per_worker and num_workers > 1:
            raise ConfigError(
                "--drop_remainder=false with a function input_context -> Dataset on "
                f"{num_workers} workers: each worker reads its own data, so the padding "
                "weights (mean over the real examples of the global batch) cannot be formed; "
                "use --drop_remainder=true or give a dataset every worker reads whole")

    def _batch_size(self) -> int:
        workers = self.workers.num_workers if self.workers is not None else 1
        return self.config.global_batch_size // (workers if self.per_worker else 1)

    def _cut(self, one_pass: tf.data.Dataset, drop: bool) -> tf.data.Dataset:
        size = self._batch_size()
        if self.batched:
            return one_pass.rebatch(size, drop_remainder=drop)
        return one_pass.batch(size, drop_remainder=drop)

    def train_batches(self, start_step: int) -> tf.data.Dataset:
        c = self.config
        context = _context(self.workers, c) if self.per_worker else _context(None, c)
        drop, size = not self.pads, self._batch_size()

        def epoch(number):
            cut = self._cut(self.one_pass(number, context), drop)
            if drop:
                return cut
            return cut.map(lambda x, y: padding.pad_batch(x, y, size))

        batches = tf.data.Dataset.counter().flat_map(epoch) if self.needs_epoch_number else (
            epoch(None).repeat())
        batches = batches.skip(start_step * c.accumulation_steps)
        batches = _concat_steps(batches, c.accumulation_steps)
        if not drop:
            batches = batches.map(padding.weigh)
        return batches if self.per_worker else _slice_for_worker(batches, c, self.workers)

    needs_epoch_number = False

    def eval_batches(self) -> tf.data.Dataset:
        return self._cut(self.eval_pass(), drop=False)


def _context(workers, config) -> tf.distribute.InputContext:
    num = workers.num_workers if workers is not None else 1
    index = workers.index if workers is not None else 0
    towers = config.global_batch_size // config.batch_size_per_tower
    return tf.distribute.InputContext(num_input_pipelines=num, input_pipeline_id=index,
                                      num_replicas_in_sync=towers)


def _example_spec(spec, batched: bool):
    if not (isinstance(spec, tuple) and len(spec) == 2):
        raise ConfigError(f"data: elements are {spec}; give elements (features, labels) "
                          "(each a tensor, tuple or dict)")
    if batched:
        spec = tf.nest.map_structure(lambda s: tf.TensorSpec(s.shape[1:], s.dtype), spec)
    return spec


def _is_batched(spec, dataset: tf.data.Dataset, what: str) -> bool:
    """See the module docstring: batches or examples, else refused."""
    leading = _leading(spec)
    if "scalar" in leading or len({d for d in leading if d is not None}) > 1:
        return False
    if all(d is None for d in leading):
        return True
    sizes = {d for d in leading if d is not None}
    from tensorflow.python.ops import gen_experimental_dataset_ops  # TF's batch-size inference
    try:
        found = int(gen_experimental_dataset_ops.compute_batch_size(dataset._variant_tensor))
    except (tf.errors.OpError, AttributeError):  # noqa: SLF001 above: the op takes the variant
        found = -1
    if found in sizes:
        return True
    raise ConfigError(
        f"{what}: a tf.data.Dataset whose elements all have the leading size {sizes.pop()} "
        f"({spec}) may be batches or single examples; pass mgloop.data.Batched(dataset) or "
        "mgloop.data.Examples(dataset)")


def _from_dataset(dataset: tf.data.Dataset, batched: bool | None, config, workers,
                  what: str) -> StreamInput:
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2):
        raise ConfigError(f"{what}: a tf.data.Dataset whose elements are {spec}; give "
                          "elements (features, labels) (each a tensor, tuple or dict)")
    if batched is None:
        batched = _is_batched(spec, dataset, what)
    if tf.data.experimental.cardinality(dataset) == 0:
        raise ConfigError(f"{what}: the tf.data.Dataset is empty")
    kind = "batches" if batched else "examples"
    return StreamInput(f"a tf.data.Dataset of {kind}", lambda epoch, context: dataset,
                       batched, spec, config, workers)


def _from_function(fn: Callable, config, workers, what: str) -> StreamInput:
    probe = fn(_context(None, config))
    if not isinstance(probe, tf.data.Dataset):
        raise ConfigError(f"{what}: the function {getattr(fn, '__name__', fn)} returned "
                          f"{_describe(probe)}; a function input_context -> tf.data.Dataset "
                          "must return a tf.data.Dataset")
    spec = probe.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2):
        raise ConfigError(f"{what}: the function's tf.data.Dataset has elements {spec}; give "
                          "elements (features, labels)")
    batched = _is_batched(spec, probe, what)
    return StreamInput("a function input_context -> Dataset",
                       lambda epoch, context: fn(context), batched, spec, config, workers,
                       per_worker=True, eval_pass=lambda: probe)


class ArrayInput(StreamInput):
    """Arrays (x, y), nested: epoch e is the permutation argsort(uniform(seed=[seed, e]))."""

    needs_epoch_number = True

    def __init__(self, arrays, config, workers, what: str):
        leaves = tf.nest.flatten(arrays)
        counts = {len(leaf) if np.ndim(leaf) else 0 for leaf in leaves}
        if len(counts) != 1 or 0 in counts:
            raise ConfigError(f"{what}: arrays of {sorted(counts)} examples (leading sizes "
                              f"{[np.shape(leaf) for leaf in leaves]}); every array of (x, y) "
                              "needs the same number of examples along its first axis")
        self.count = counts.pop()
        if config.drop_remainder and self.count < config.global_batch_size:
            raise ConfigError(f"{what}: {self.count} examples are fewer than "
                              f"--global_batch_size={config.global_batch_size}, so with "
                              "--drop_remainder=true no full batch fits in an epoch; use a "
                              "smaller batch or --drop_remainder=false")
        def tensor(leaf):  # float64 arrays become float32, as Keras's fit reads numpy
            leaf = tf.convert_to_tensor(leaf)
            return tf.cast(leaf, tf.float32) if leaf.dtype == tf.float64 else leaf
        with tf.device("/device:CPU:0"):
            self.tensors = tf.nest.map_structure(tensor, arrays)
        spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype),
                                     self.tensors)
        seed = config.seed

        def one_pass(epoch, context):
            if epoch is None:  # eval: in order
                order = tf.range(self.count, dtype=tf.int64)
            else:
                keys = tf.random.stateless_uniform(
                    [self.count], seed=tf.stack([tf.constant(seed, tf.int64), epoch]))
                order = tf.cast(tf.argsort(keys, stable=True), tf.int64)
            return tf.data.Dataset.from_tensor_slices(order)

        super().__init__("numpy arrays (x, y)", one_pass, False, spec, config, workers)

    def _cut(self, one_pass, drop):
        gather = lambda i: tf.nest.map_structure(lambda t: tf.gather(t, i), self.tensors)  # noqa
        return one_pass.batch(self._batch_size(), drop_remainder=drop).map(gather)

    def eval_batches(self):
        return self._cut(self.one_pass(None, None), drop=False)


def _is_arrays(obj) -> bool:
    return isinstance(obj, (tuple, list)) and len(obj) == 2 and all(
        isinstance(leaf, (np.ndarray, tf.Tensor)) for leaf in tf.nest.flatten(obj))


def check_accepted(obj, what: str = "train_data") -> None:
    """Refuses, in one line and without TensorFlow work, what `as_input` cannot take."""
    if obj is None or isinstance(obj, (InMemoryDataset, Batched, Examples, tf.data.Dataset)):
        return
    if _is_arrays(obj) or (callable(obj) and not isinstance(obj, type)):
        return
    if isinstance(obj, dict):
        raise ConfigError(f"{what}: got a dict of {sorted(map(str, obj))[:5]} with no labels; "
                          f"give (features_dict, labels); accepted: {ACCEPTED}")
    raise ConfigError(f"{what}: got {_describe(obj)}; give {ACCEPTED}")


def as_input(obj, config, workers=None, what: str = "train_data") -> Input:
    """The run's input from what the user gave (see the module docstring); `config` is the
    validated Config, `workers` the cluster.Cluster or None; `what` names the argument in
    errors. None: --dataset. Call it after the devices are set up (it may start TensorFlow)."""
    check_accepted(obj, what)
    from mgloop import data  # the registry of --dataset names (data/__init__.py)
    if obj is None:
        return data.load_input(config, workers)
    if isinstance(obj, InMemoryDataset):
        return InMemoryInput(obj, config, workers)
    if isinstance(obj, (Batched, Examples)):
        return _from_dataset(obj.dataset, isinstance(obj, Batched), config, workers, what)
    if isinstance(obj, tf.data.Dataset):
        return _from_dataset(obj, None, config, workers, what)
    if _is_arrays(obj):
        return ArrayInput(tuple(obj), config, workers, what)
    return _from_function(obj, config, workers, what)
