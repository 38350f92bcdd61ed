"""The body of mgloop.aggregation (its package module loads it on first use; see there).
"""

from __future__ import annotations

from mgloop.aggregation.base import REPLICATED, SHARED, Aggregation, Options, option
from mgloop.aggregation.plugins import load_plugins
from mgloop.errors import ConfigError

_REGISTRY: dict[str, type[Aggregation]] = {}


def register(cls: type[Aggregation]) -> type[Aggregation]:
    """Class decorator: makes `cls.name` a valid `--aggregation`. The same class imported
    again (a module reloaded) replaces itself; another class of the same name is refused."""
    known = _REGISTRY.get(cls.name)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__,
                                                                        cls.__qualname__):
        raise ValueError(f"aggregation {cls.name!r} is registered twice ({known.__module__}."
                         f"{known.__qualname__} and {cls.__module__}.{cls.__qualname__})")
    _REGISTRY[cls.name] = cls
    return cls


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(spec: str) -> type[Aggregation]:
    """The method class a spec (or a bare name) names."""
    name = options_lib.split(spec)[0]
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"--aggregation={name!r} is not one of: {', '.join(names())}") from None


def parse(spec: str) -> tuple[type[Aggregation], Options]:
    """`NAME` or `NAME:key=value,...` -> (the method's class, its options)."""
    method = get(spec)
    return method, options_lib.parse_options(method, options_lib.split(spec)[1], spec)


def make(spec: str, devices, transport_dtype: str = "float32", **construction) -> Aggregation:
    """The method `spec` names, with its options, on `devices` (a DeviceSet); `construction`:
    what the run gives it besides (base.py's `cluster`, `between_workers`, `traffic`; a
    compressor's `bucket_bytes`; local steps' `live`: nodes.make)."""
    method, options = parse(spec)
    return method(devices, options, transport_dtype, **construction)


def canonical_spec(spec: str) -> str:
    """NAME and the options that differ from their defaults, in field order."""
    return options_lib.format_spec(*parse(spec))


def describe(spec: str) -> dict[str, object]:
    """{'aggregation': NAME, 'aggregation/KEY': value, ...} of every option (defaults too)."""
    return options_lib.describe(*parse(spec))


from mgloop.aggregation import options as options_lib  # noqa: E402

# Registration happens on import; keep this list in the order of docs/methods/.
from mgloop.aggregation import parameter_server  # noqa: E402,F401
from mgloop.aggregation import reduce_broadcast  # noqa: E402,F401
from mgloop.aggregation import ring  # noqa: E402,F401
from mgloop.aggregation import hierarchical  # noqa: E402,F401
from mgloop.aggregation import collective  # noqa: E402,F401
from mgloop.aggregation import independent  # noqa: E402,F401
from mgloop.aggregation import local_steps  # noqa: E402,F401
from mgloop.aggregation import streaming_diloco  # noqa: E402,F401
from mgloop.aggregation import sparta  # noqa: E402,F401
from mgloop.aggregation import sparseloco  # noqa: E402,F401
from mgloop.aggregation import stale  # noqa: E402,F401
from mgloop.aggregation import colocate  # noqa: E402,F401
from mgloop.aggregation import adasum  # noqa: E402,F401
from mgloop.aggregation import median  # noqa: E402,F401
from mgloop.aggregation import trimmed_mean  # noqa: E402,F401
from mgloop.aggregation import krum  # noqa: E402,F401
from mgloop.aggregation import bulyan  # noqa: E402,F401
from mgloop.aggregation import geomedian  # noqa: E402,F401
from mgloop.aggregation import centered_clipping  # noqa: E402,F401
from mgloop.aggregation.compression import topk  # noqa: E402,F401
from mgloop.aggregation.compression import randomk  # noqa: E402,F401
from mgloop.aggregation.compression import threshold  # noqa: E402,F401
from mgloop.aggregation.compression import dgc  # noqa: E402,F401
from mgloop.aggregation.compression import qsgd  # noqa: E402,F401
from mgloop.aggregation.compression import onebit  # noqa: E402,F401
from mgloop.aggregation.compression import signs  # noqa: E402,F401
from mgloop.aggregation.compression import powersgd  # noqa: E402,F401
from mgloop.aggregation.compression import demo  # noqa: E402,F401
from mgloop.aggregation import validation  # noqa: E402,F401

__all__ = ["Aggregation", "Options", "option", "SHARED", "REPLICATED", "register", "names",
           "get", "parse", "make", "canonical_spec", "describe", "load_plugins"]
