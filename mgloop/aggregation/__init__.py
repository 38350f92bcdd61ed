"""Gradient aggregation methods, one small module each, looked up by name.

Adding a method: subclass `Aggregation` in a new module, decorate it with
`@register`, and import the module below. Its name becomes a valid
`--aggregation` value.
"""

from __future__ import annotations

from mgloop.aggregation.base import REPLICATED, SHARED, Aggregation, Options
from mgloop.errors import ConfigError

_REGISTRY: dict[str, type[Aggregation]] = {}


def register(cls: type[Aggregation]) -> type[Aggregation]:
    if cls.name in _REGISTRY:
        raise ValueError(f"aggregation {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> type[Aggregation]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"--aggregation={name!r} is not one of: {', '.join(names())}") from None


# Registration happens on import; keep this list in the order of the README.
from mgloop.aggregation import parameter_server  # noqa: E402,F401
from mgloop.aggregation import reduce_broadcast  # noqa: E402,F401
from mgloop.aggregation import ring  # noqa: E402,F401
from mgloop.aggregation import hierarchical  # noqa: E402,F401
from mgloop.aggregation import collective  # noqa: E402,F401
from mgloop.aggregation import independent  # noqa: E402,F401
from mgloop.aggregation import colocate  # noqa: E402,F401

__all__ = ["Aggregation", "Options", "SHARED", "REPLICATED", "register", "names", "get"]
