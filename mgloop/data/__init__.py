"""Datasets by `--dataset` name; each loader returns an `InMemoryDataset`."""

from __future__ import annotations

from typing import Callable

from mgloop.data import synthetic
from mgloop.data.base import InMemoryDataset
from mgloop.errors import ConfigError

_LOADERS: dict[str, Callable[..., InMemoryDataset]] = {
    "synthetic": lambda seed: synthetic.make(seed),
}


def names() -> list[str]:
    return sorted(_LOADERS)


def load(name: str, seed: int) -> InMemoryDataset:
    if name not in _LOADERS:
        raise ConfigError(f"--dataset={name!r} is not one of: {', '.join(names())}")
    return _LOADERS[name](seed)


__all__ = ["InMemoryDataset", "names", "load"]
