"""Checks shared by the file readers: one-line `ConfigError`s naming `--data_dir` and the file."""

from __future__ import annotations

import os

import numpy as np

from mgloop.errors import ConfigError


def refuse(data_dir: str, message: str) -> ConfigError:
    return ConfigError(f"--data_dir={data_dir}: {message}")


def require_file(data_dir: str, name: str, expected: str) -> str:
    """The path of `name` in `data_dir`; refuses a missing file, saying what is `expected`."""
    path = os.path.join(data_dir, name)
    if not os.path.isfile(path):
        raise refuse(data_dir, f"{path} is missing; {expected}")
    return path


def check_labels(data_dir: str, path: str, labels: np.ndarray, num_classes: int) -> None:
    """Refuses a label outside 0..num_classes-1, naming the first example that has one."""
    bad = np.flatnonzero(labels >= num_classes)
    if bad.size:
        raise refuse(data_dir, f"{path} example {int(bad[0])} has label {int(labels[bad[0]])}; "
                               f"labels must be 0..{num_classes - 1}")


def read_error(data_dir: str, path: str, error: Exception, expected: str) -> ConfigError:
    """A file that cannot be read through (e.g. a truncated or corrupt gzip stream)."""
    detail = str(error).strip().splitlines()[0]
    return refuse(data_dir, f"{path} could not be read ({detail}); {expected}")
