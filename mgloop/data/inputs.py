"""The run's inputs that `as_input` (user_input.py) makes: what a step reads, from where.

    InMemoryInput  an InMemoryDataset (the --dataset built-ins): epochs.py's (seed, step) stream
    StreamInput    a user's tf.data pipeline, or a function of an InputContext: passes over
                   it, cut into global batches, short batches dropped or padded (padding.py)
    ArrayInput     arrays (x, y): a seeded permutation per epoch, cut like a stream

Each is made of the validated data options (`DataOptions`: the batch, --drop_remainder,
--partition) and a `Reading`: what it needs of the run beyond them.
`train_batches(start_step)` is this worker's stream of step batches from `start_step` on
(the global step is the input position: a resumed run reads what an uninterrupted one
reads); `eval_batches()` the eval examples once. How batches are formed: user_input.py.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import tensorflow as tf

from mgloop.data import batch_split
from mgloop.data import epochs
from mgloop.data import padding
from mgloop.data import partition
from mgloop.data.base import InMemoryDataset
from mgloop.data.options import DataOptions
from mgloop.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Reading:
    """What an input needs of the run beyond its data options."""

    workers: object = None  # cluster.workers.Cluster of the TF_CONFIG job, or None: one process
    seed: int = 0  # --seed: the epochs' permutations and the partition's draws
    micro_batches: int = 1  # --accumulation_steps: global batches per step
    # (n, "nodes" or "towers"): the clients --partition deals to (partition.clients_of);
    # None: every tower a client
    clients: tuple[int, str] | None = None
    logdir: str | None = None  # where partition.json is written (None: nowhere)

    @property
    def num_workers(self) -> int:
        return self.workers.num_workers if self.workers is not None else 1


def num_towers(options: DataOptions) -> int:
    """The towers over all workers of validated data options (global / per-tower batch)."""
    return options.global_batch_size // options.batch_size_per_tower


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


def _slice_for_worker(batches: tf.data.Dataset, reading: Reading) -> tf.data.Dataset:
    workers = reading.workers
    if workers is None or workers.num_workers == 1:
        return batches
    part = functools.partial(batch_split.worker_part, workers=workers.num_workers,
                             index=workers.index, micro_batches=reading.micro_batches)
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

    def __init__(self, dataset: InMemoryDataset, options: DataOptions, reading: Reading):
        self.parts = None  # --partition=dirichlet: the clients' example indices
        if partition.parse(options.partition).name == partition.IID:
            epochs.check_fits(dataset, options.global_batch_size, options.drop_remainder)
        else:
            self.parts = _partition(dataset, options, reading)
        if len(dataset.eval_y) == 0:
            raise ConfigError(f"--dataset={dataset.name} has no eval examples, but every run "
                              "evaluates after training (and every --eval_every steps); give "
                              "the dataset at least one eval example")
        self.dataset, self.options, self.reading = dataset, options, reading
        self.description = f"--dataset={dataset.name}" if dataset.name else "an InMemoryDataset"
        self.features_spec = tf.TensorSpec(dataset.input_shape, tf.float32)
        self.labels_spec = tf.TensorSpec(dataset.train_y.shape[1:], tf.as_dtype(
            dataset.train_y.dtype))
        self.num_classes = dataset.num_classes

    def train_batches(self, start_step: int) -> tf.data.Dataset:
        o, r = self.options, self.reading
        batches = epochs.step_batches(self.dataset, o.global_batch_size, r.micro_batches,
                                      r.seed, start_step, o.drop_remainder, self.parts)
        return _slice_for_worker(batches, r)

    def eval_batches(self) -> tf.data.Dataset:
        return self.dataset.eval_batches(self.options.global_batch_size)


def _partition(dataset: InMemoryDataset, options: DataOptions, reading: Reading) -> list:
    """The clients' parts of --partition=dirichlet (partition.py), checked and recorded (by
    the chief); every worker deals the same parts and keeps its slice of the global batch
    (`train_batches`), its own clients' shards."""
    labels = np.asarray(dataset.train_y)
    spec, seed = options.partition, reading.seed
    where = f"--partition={spec} with --dataset={dataset.name or 'the given data'}"
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ConfigError(f"{where}: its labels are {labels.dtype} {labels.shape[1:]} per "
                          "example, not one integer class; use --partition=iid")
    clients, unit = reading.clients or (num_towers(options), "towers")
    parts = partition.dirichlet_parts(labels, dataset.num_classes, clients,
                                      partition.parse(spec).alpha, seed)
    partition.check_parts(parts, options.global_batch_size // clients, options.drop_remainder,
                          spec, seed, unit)
    partition.record(spec, seed, reading.logdir, labels, dataset.num_classes, parts, unit,
                     write=reading.workers is None or reading.workers.is_chief)
    return parts


class StreamInput(Input):
    """A user's data: `one_pass(epoch, context)` gives one pass over it (examples or batches).

    `per_worker`: the pass is this worker's data (a function of the InputContext), cut into
    batches of B/W; else every worker reads the whole pass and keeps its slice."""

    def __init__(self, description: str, one_pass, batched: bool, spec,
                 options: DataOptions, reading: Reading, per_worker: bool = False,
                 eval_pass=None):
        self.description, self.one_pass, self.batched = description, one_pass, batched
        self.options, self.reading, self.per_worker = options, reading, per_worker
        self.eval_pass = eval_pass or (lambda: one_pass(None, context_for(None, options)))
        self.features_spec, self.labels_spec = _example_spec(spec, batched)
        self.pads = not options.drop_remainder
        num_workers = reading.num_workers
        if self.pads and per_worker and num_workers > 1:
            raise ConfigError(
                "--drop_remainder=false with a function input_context -> Dataset on "
                f"{num_workers} workers: each worker reads its own data, so the padding "
                "weights (mean over the real examples of the global batch) cannot be formed; "
                "use --drop_remainder=true or give a dataset every worker reads whole")

    def _batch_size(self) -> int:
        workers = self.reading.num_workers if self.per_worker else 1
        return self.options.global_batch_size // workers

    def _cut(self, one_pass: tf.data.Dataset, drop: bool) -> tf.data.Dataset:
        size = self._batch_size()
        if self.batched:
            return one_pass.rebatch(size, drop_remainder=drop)
        return one_pass.batch(size, drop_remainder=drop)

    def train_batches(self, start_step: int) -> tf.data.Dataset:
        o, r = self.options, self.reading
        context = context_for(r.workers if self.per_worker else None, o)
        drop, size = not self.pads, self._batch_size()

        def epoch(number):
            cut = self._cut(self.one_pass(number, context), drop)
            if drop:
                return cut
            return cut.map(lambda x, y: padding.pad_batch(x, y, size))

        batches = tf.data.Dataset.counter().flat_map(epoch) if self.needs_epoch_number else (
            epoch(None).repeat())
        batches = batches.skip(start_step * r.micro_batches)
        batches = _concat_steps(batches, r.micro_batches)
        if not drop:
            batches = batches.map(padding.weigh)
        return batches if self.per_worker else _slice_for_worker(batches, r)

    needs_epoch_number = False

    def eval_batches(self) -> tf.data.Dataset:
        return self._cut(self.eval_pass(), drop=False)


def context_for(workers, options: DataOptions) -> tf.distribute.InputContext:
    """tf.distribute's InputContext of this worker (workers None: one pipeline)."""
    num = workers.num_workers if workers is not None else 1
    index = workers.index if workers is not None else 0
    return tf.distribute.InputContext(num_input_pipelines=num, input_pipeline_id=index,
                                      num_replicas_in_sync=num_towers(options))


class ArrayInput(StreamInput):
    """Arrays (x, y), nested: epoch e is the permutation argsort(uniform(seed=[seed, e]))."""

    needs_epoch_number = True

    def __init__(self, arrays, options: DataOptions, reading: Reading, what: str):
        leaves = tf.nest.flatten(arrays)
        counts = {len(leaf) if np.ndim(leaf) else 0 for leaf in leaves}
        if len(counts) != 1 or 0 in counts:
            raise ConfigError(f"{what}: arrays of {sorted(counts)} examples (leading sizes "
                              f"{[np.shape(leaf) for leaf in leaves]}); every array of (x, y) "
                              "needs the same number of examples along its first axis")
        self.count = counts.pop()
        if options.drop_remainder and self.count < options.global_batch_size:
            raise ConfigError(f"{what}: {self.count} examples are fewer than "
                              f"--global_batch_size={options.global_batch_size}, so with "
                              "--drop_remainder=true no full batch fits in an epoch; use a "
                              "smaller batch or --drop_remainder=false")
        def tensor(leaf):  # float64 arrays become float32, as Keras's fit reads numpy
            leaf = tf.convert_to_tensor(leaf)
            return tf.cast(leaf, tf.float32) if leaf.dtype == tf.float64 else leaf
        with tf.device("/device:CPU:0"):
            self.tensors = tf.nest.map_structure(tensor, arrays)
        spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape[1:], t.dtype),
                                     self.tensors)
        seed = reading.seed

        def one_pass(epoch, context):
            if epoch is None:  # eval: in order
                order = tf.range(self.count, dtype=tf.int64)
            else:
                keys = tf.random.stateless_uniform(
                    [self.count], seed=tf.stack([tf.constant(seed, tf.int64), epoch]))
                order = tf.cast(tf.argsort(keys, stable=True), tf.int64)
            return tf.data.Dataset.from_tensor_slices(order)

        super().__init__("numpy arrays (x, y)", one_pass, False, spec, options, reading)

    def _cut(self, one_pass, drop):
        gather = lambda i: tf.nest.map_structure(lambda t: tf.gather(t, i), self.tensors)  # noqa
        return one_pass.batch(self._batch_size(), drop_remainder=drop).map(gather)

    def eval_batches(self):
        return self._cut(self.one_pass(None, None), drop=False)


def _example_spec(spec, batched: bool):
    if not (isinstance(spec, tuple) and len(spec) == 2):
        raise ConfigError(f"data: elements are {spec}; give elements (features, labels) "
                          "(each a tensor, tuple or dict)")
    if batched:
        spec = tf.nest.map_structure(lambda s: tf.TensorSpec(s.shape[1:], s.dtype), spec)
    return spec
