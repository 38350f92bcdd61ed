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
its contiguous B/W slice of each global batch (batch_split.worker_part); a function
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
from typing import Callable

import numpy as np
import tensorflow as tf

from mgloop.data.base import InMemoryDataset
from mgloop.data.inputs import (ArrayInput, InMemoryInput, Input, Reading, StreamInput,
                                context_for)
from mgloop.data.options import DataOptions
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


def _from_dataset(dataset: tf.data.Dataset, batched: bool | None, options: DataOptions,
                  reading: Reading, what: str) -> StreamInput:
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2):
        raise ConfigError(f"{what}: a tf.data.Dataset whose elements are {spec}; give "
                          "elements (features, labels) (each a tensor, tuple or dict)")
    if batched is None:
        batched = _is_batched(spec, dataset, what)
    count = int(tf.data.experimental.cardinality(dataset))  # < 0: unknown or infinite
    if count == 0:
        raise ConfigError(f"{what}: the tf.data.Dataset is empty")
    if not batched and options.drop_remainder and 0 < count < options.global_batch_size:
        raise ConfigError(f"{what}: {count} examples are fewer than --global_batch_size="
                          f"{options.global_batch_size}, so with --drop_remainder=true no full "
                          "batch fits in a pass; use a smaller batch or --drop_remainder=false")
    kind = "batches" if batched else "examples"
    return StreamInput(f"a tf.data.Dataset of {kind}", lambda epoch, context: dataset,
                       batched, spec, options, reading)


def _from_function(fn: Callable, options: DataOptions, reading: Reading,
                   what: str) -> StreamInput:
    probe = fn(context_for(None, options))
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
                       lambda epoch, context: fn(context), batched, spec, options, reading,
                       per_worker=True, eval_pass=lambda: probe)


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


def as_input(obj, options: DataOptions, reading: Reading = Reading(),
             what: str = "train_data") -> Input:
    """The run's input from what the user gave (see the module docstring); `options` are
    the validated data options, `reading` what the input needs of the run beyond them;
    `what` names the argument in errors. None: --dataset. Call it after the devices are set
    up (it may start TensorFlow)."""
    check_accepted(obj, what)
    from mgloop import data  # the registry of --dataset names (data/__init__.py)
    if obj is None:
        return data.load_input(options, reading)
    if isinstance(obj, InMemoryDataset):
        return InMemoryInput(obj, options, reading)
    if what != "eval_data" and options.partition != "iid":
        raise ConfigError(f"--partition={options.partition} with {what} given as "
                          f"{_describe(obj)}: only an in-memory labelled dataset (--dataset or "
                          "a mgloop.data.InMemoryDataset) can be dealt to clients by class; "
                          "use --partition=iid")
    if isinstance(obj, (Batched, Examples)):
        return _from_dataset(obj.dataset, isinstance(obj, Batched), options, reading, what)
    if isinstance(obj, tf.data.Dataset):
        return _from_dataset(obj, None, options, reading, what)
    if _is_arrays(obj):
        return ArrayInput(tuple(obj), options, reading, what)
    return _from_function(obj, options, reading, what)
