"""`text`: byte-level language modelling on the UTF-8 text files under `--data_dir`.

Tokens are bytes (a vocabulary of 256, `num_classes`): every regular file under
`--data_dir` (recursively, hidden files and folders left out) in sorted path order,
its bytes concatenated into one stream t_0 .. t_(M-1). With L = `--sequence_length`,
sequence i is

    x_i = t[i L : i L + L]          (int32 [L], the model's input)
    y_i = t[i L + 1 : i L + L + 1]  (int32 [L], the next token at every position)

for i < floor((M - 1) / L): consecutive, non-overlapping windows (the bytes after the
last full window are unused). The last max(1, floor(N / 10)) of the N sequences are
the eval split, the others the train split (at least one each). The loss is the
cross-entropy of the next token, its mean over every token of the global batch
(B L tokens: every sequence has L, so the mean over towers of their shards' means is
the mean over the global batch); the accuracy and perplexity are per token.
"""

from __future__ import annotations

import os

import numpy as np

from mgloop.data.base import InMemoryDataset
from mgloop.errors import ConfigError

VOCABULARY = 256  # one token per byte value
DEFAULT_SEQUENCE_LENGTH = 64
EVAL_FRACTION = 10  # one sequence in EVAL_FRACTION is held out (at least one)


def text_files(data_dir: str) -> list[str]:
    """Every regular file under `data_dir`, hidden ones left out, in sorted path order."""
    found = []
    for root, folders, files in os.walk(data_dir):
        folders[:] = [f for f in folders if not f.startswith(".")]
        found += [os.path.join(root, f) for f in files if not f.startswith(".")]
    return sorted(found)


def check_files(data_dir: str) -> None:
    """Refuses a folder without files, or holding a file that is not UTF-8 text."""
    files = text_files(data_dir)
    if not files:
        raise ConfigError(f"--data_dir={data_dir} holds no files; --dataset=text reads the "
                          "UTF-8 text files under it: give a --data_dir that holds some")
    for path in files:
        with open(path, "rb") as handle:
            try:
                handle.read().decode("utf-8")
            except UnicodeDecodeError as error:
                raise ConfigError(f"--dataset=text: {path} is not UTF-8 text (byte "
                                  f"{error.start}); remove it from --data_dir") from None


def tokens(data_dir: str) -> np.ndarray:
    """The byte stream of every file (text_files order), uint8 [M]."""
    parts = []
    for path in text_files(data_dir):
        with open(path, "rb") as handle:
            parts.append(handle.read())
    return np.frombuffer(b"".join(parts), np.uint8)


def sequences(stream: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) int32 [N, length]: the windows of the module docstring."""
    count = (len(stream) - 1) // length
    x = stream[:count * length].reshape(count, length)
    y = stream[1:count * length + 1].reshape(count, length)
    return x.astype(np.int32), y.astype(np.int32)


def from_stream(name: str, stream: np.ndarray, sequence_length: int | None,
                where: str) -> InMemoryDataset:
    """The dataset `name` of a byte stream: its windows (`sequences`), the last tenth the
    eval split; `where` names the stream's origin in the refusal of too short a stream."""
    length = DEFAULT_SEQUENCE_LENGTH if sequence_length is None else sequence_length
    x, y = sequences(stream, length)
    if len(x) < 2:
        raise ConfigError(f"--dataset={name}: the {len(stream)} bytes {where} make {len(x)} "
                          f"sequences of --sequence_length={length}, fewer than the 2 needed "
                          "(one to train, one to evaluate); give more text or a shorter "
                          "--sequence_length")
    held_out = max(1, len(x) // EVAL_FRACTION)
    return InMemoryDataset(name, x[:-held_out], y[:-held_out], x[-held_out:], y[-held_out:],
                           VOCABULARY)


def load(data_dir: str, sequence_length: int | None = None) -> InMemoryDataset:
    return from_stream("text", tokens(data_dir), sequence_length,
                       f"under --data_dir={data_dir}")
