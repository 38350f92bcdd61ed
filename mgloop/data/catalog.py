"""The body of mgloop.data (its package module loads it on first use; see there).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from mgloop.data import cifar10
from mgloop.data import digits
from mgloop.data import mnist
from mgloop.data import partition
from mgloop.data import python_text
from mgloop.data import random_binary
from mgloop.data import synthetic
from mgloop.data import user_input
from mgloop.data import text
from mgloop.data.base import InMemoryDataset
from mgloop.data.inputs import Reading
from mgloop.data.options import DEFAULT_GLOBAL_BATCH_SIZE, DataOptions
from mgloop.data.padding import Weighted
from mgloop.data.user_input import Batched, Examples, Input, as_input
from mgloop.errors import ConfigError
from mgloop.settings import in_range


@dataclasses.dataclass(frozen=True)
class _Source:
    load: Callable[[int, str | None], InMemoryDataset]  # (seed, data_dir) -> dataset
    check_files: Callable[[str], None] | None = None  # None: reads no files
    files: str = ""  # what --data_dir must hold, for the error when it is not set
    # registered (`register`): (data_dir, input_context) -> tf.data.Dataset, and eval's
    train: Callable | None = None
    eval: Callable | None = None
    num_classes: int | None = None
    sequenced: bool = False  # True: `load` also takes the --sequence_length
    # files installed with a package (no --data_dir): () -> None, refuses a missing or bad one
    check_bundled: Callable[[], None] | None = None
    unfit_models: dict = dataclasses.field(default_factory=dict)  # --model -> why it cannot


_SOURCES: dict[str, _Source] = {
    "synthetic": _Source(lambda seed, data_dir: synthetic.make(seed)),
    "synthetic_cifar": _Source(lambda seed, data_dir: synthetic.make(
        seed, num_train=4096, input_shape=synthetic.CIFAR_SHAPE, name="synthetic_cifar")),
    "random_binary": _Source(lambda seed, data_dir: random_binary.make(seed)),
    "cifar10": _Source(lambda seed, data_dir: cifar10.load(data_dir), cifar10.check_files,
                       "data_batch_1.bin .. data_batch_5.bin and test_batch.bin"),
    "mnist": _Source(lambda seed, data_dir: mnist.load(data_dir), mnist.check_files,
                     "the four MNIST IDX files"),
    "text": _Source(lambda seed, data_dir, sequence_length: text.load(data_dir, sequence_length),
                    text.check_files, "UTF-8 text files", sequenced=True),
    "digits": _Source(lambda seed, data_dir: digits.load(), check_bundled=digits.check_files,
                      unfit_models=digits.UNFIT_MODELS),
    "python_text": _Source(
        lambda seed, data_dir, sequence_length: python_text.load(sequence_length),
        check_bundled=python_text.check_files, sequenced=True),
}


def register(name: str, train: Callable, eval: Callable | None = None,
             files: str = "the dataset's files", num_classes: int | None = None) -> None:
    """Registers `--dataset=name` (from a --plugin module): `train(data_dir, input_context)`
    returns a tf.data.Dataset of (features, labels) examples or batches of this worker's
    training data (user_input.py: how global batches are formed), `eval(data_dir)` (None:
    the run has no eval data) its eval data; `files` says what --data_dir must hold;
    `num_classes` lets the built-in --model's build on it (None: pass model_fn)."""
    if name in _SOURCES and _SOURCES[name].train is not train:
        raise ConfigError(f"--dataset={name} is already registered; pick another name")
    _SOURCES[name] = _Source(None, lambda data_dir: None, files, train, eval, num_classes)


def load_input(options: DataOptions, reading: Reading = Reading()) -> Input:
    """The input of `--dataset` (and --data_dir) of validated data options."""
    name, data_dir = options.dataset, options.data_dir
    source = _source(name)
    if source.train is None:
        return user_input.InMemoryInput(load(name, reading.seed, data_dir,
                                             options.sequence_length), options, reading)
    fn = lambda context: source.train(data_dir, context)  # noqa: E731
    fn.__name__ = f"--dataset={name}"
    made = user_input.as_input(fn, options, reading, what=f"--dataset={name}")
    made.description = f"--dataset={name} (--data_dir={data_dir})"
    made.num_classes = source.num_classes
    if source.eval is not None:
        made.eval_pass, made.has_eval_split = (lambda: source.eval(data_dir)), True
    return made


def names() -> list[str]:
    return sorted(_SOURCES)


def _source(name: str) -> _Source:
    if name not in _SOURCES:
        raise ConfigError(f"--dataset={name!r} is not one of: {', '.join(names())}")
    return _SOURCES[name]


def streamed(name: str) -> bool:
    """A registered (--plugin) dataset, read as a tf.data stream of unknown shapes until it
    is read; every built-in one is held in memory."""
    return _source(name).train is not None


def has_eval_data(name: str) -> bool:
    """False only for a registered dataset given no eval= (its runs evaluate nothing); a
    built-in one always has eval examples (an empty eval split is refused when loaded)."""
    source = _source(name)
    return source.train is None or source.eval is not None


def file_datasets() -> list[str]:
    return sorted(name for name, source in _SOURCES.items() if source.check_files)


def check(name: str, data_dir: str | None) -> None:
    """Refuses a missing, unneeded or malformed `--data_dir` for `--dataset=name`."""
    source = _source(name)
    if source.check_files is None:
        if data_dir is not None:
            raise ConfigError(f"--data_dir={data_dir} is set but --dataset={name} reads no "
                              f"files; drop --data_dir or use --dataset="
                              f"{' or '.join(file_datasets())}")
        if source.check_bundled is not None:
            source.check_bundled()
        return
    if data_dir is None:
        raise ConfigError(f"--dataset={name} reads its files from --data_dir; set --data_dir "
                          f"to the folder holding {source.files}")
    if not os.path.isdir(data_dir):
        raise ConfigError(f"--data_dir={data_dir} is not a directory; give the folder holding "
                          f"{source.files}")
    source.check_files(data_dir)


def check_dataset_and_batch(options: DataOptions, towers: int,
                   devices_flag: str) -> tuple[int, str | None]:
    """--dataset and its --data_dir (expanded), and the batch: returns (global batch, data_dir).

    Exactly one of --global_batch_size and --batch_size_per_tower may be set (default: a
    global batch of 128); the global batch must split into `towers` equal shards
    (`devices_flag`: how they were asked for, in the message)."""
    data_dir = os.path.expanduser(options.data_dir) if options.data_dir is not None else None
    check(options.dataset, data_dir)
    if options.sequence_length is not None:
        if not _source(options.dataset).sequenced:
            raise ConfigError(f"--sequence_length={options.sequence_length} is set but "
                              f"--dataset={options.dataset} has no sequences; drop it or use "
                              "--dataset=text or python_text")
        in_range("sequence_length", options.sequence_length, low=1)
    global_batch, per_tower = options.global_batch_size, options.batch_size_per_tower
    if global_batch is not None and per_tower is not None:
        raise ConfigError("--global_batch_size and --batch_size_per_tower are both set; "
                          "set one (the other follows from the tower count)")
    if per_tower is not None:
        in_range("batch_size_per_tower", per_tower, low=1)
        return per_tower * towers, data_dir
    global_batch = DEFAULT_GLOBAL_BATCH_SIZE if global_batch is None else global_batch
    in_range("global_batch_size", global_batch, low=1)
    if global_batch % towers:
        raise ConfigError(
            f"--global_batch_size={global_batch} does not split into {towers} equal tower "
            f"shards (--devices={devices_flag}); use a multiple of {towers}")
    return global_batch, data_dir


def check_model(options: DataOptions, model: str) -> None:
    """Refuses a --model that --dataset cannot feed (e.g. digits' 8x8 images are too small
    for minigooglenet)."""
    unfit = _source(options.dataset).unfit_models
    if model in unfit:
        raise ConfigError(f"--model={model} cannot train on --dataset={options.dataset}: "
                          f"{unfit[model]}; use another --model")


def check_partition(options: DataOptions) -> None:
    """--partition (partition.py): dirichlet only for a built-in labelled in-memory dataset
    (not a registered one, not a sequenced one)."""
    source = _source(options.dataset)
    kind = ("a --plugin dataset is read as a tf.data stream, not held in memory"
            if source.train is not None else
            "it is a language-model dataset (sequences of tokens, no class label per example)"
            if source.sequenced else None)
    partition.check_spec(options.partition, options.dataset, kind)


def sequence_length_of(options: DataOptions) -> int | None:
    """--sequence_length, its default filled in for a sequenced dataset (None otherwise)."""
    if options.sequence_length is None and _source(options.dataset).sequenced:
        return text.DEFAULT_SEQUENCE_LENGTH
    return options.sequence_length


def load(name: str, seed: int, data_dir: str | None = None,
         sequence_length: int | None = None) -> InMemoryDataset:
    """`sequence_length`: of a sequenced dataset (text); None: its default."""
    source = _source(name)
    if source.sequenced:
        return source.load(seed, data_dir, sequence_length)
    return source.load(seed, data_dir)


__all__ = ["InMemoryDataset", "names", "check", "check_dataset_and_batch", "check_model", "load",
           "register", "load_input", "as_input", "Input", "Reading", "Batched", "Examples",
           "Weighted"]
