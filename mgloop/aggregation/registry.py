"""The body of mgloop.aggregation (its package module loads it on first use; see there).
"""

from __future__ import annotations

import functools
import importlib

from mgloop.aggregation.base import REPLICATED, SHARED, Aggregation, Options, option
from mgloop.aggregation.capabilities import FIELDS, Capabilities
from mgloop.aggregation.plugins import load_plugins
from mgloop.errors import ConfigError

_REGISTRY: dict[str, type[Aggregation]] = {}


def register(cls: type[Aggregation]) -> type[Aggregation]:
    """Class decorator: makes `cls.name` a valid `--aggregation`. The same class imported
    again (a module reloaded) replaces itself; another class of the same name is refused, and
    so is a class with no `capabilities` record (capabilities.py) or one that still declares a
    capability as a loose class attribute (`exact = False`: an old plugin's, else ignored)."""
    _check_capabilities(cls)
    known = _REGISTRY.get(cls.name)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__,
                                                                        cls.__qualname__):
        raise ValueError(f"aggregation {cls.name!r} is registered twice ({known.__module__}."
                         f"{known.__qualname__} and {cls.__module__}.{cls.__qualname__})")
    _REGISTRY[cls.name] = cls
    return cls


def _check_capabilities(cls: type[Aggregation]) -> None:
    """Raises TypeError (one line, naming `cls`) unless `cls` has a `Capabilities` record and
    none of its classes declares one of the record's fields as a class attribute."""
    where = f"aggregation class {cls.__module__}.{cls.__qualname__}"
    loose = sorted({n for klass in cls.__mro__ for n in vars(klass) if n in FIELDS})
    if loose:
        raise TypeError(f"{where} declares {', '.join(loose)} as class attributes; declare "
                        f"them in one record: capabilities = Capabilities(layout=..., ...) "
                        f"(mgloop.aggregation.Capabilities, docs/plugins.md)")
    if not isinstance(getattr(cls, "capabilities", None), Capabilities):
        raise TypeError(f"{where} has no capabilities record: declare capabilities = "
                        f"Capabilities(layout=..., ...) (mgloop.aggregation.Capabilities, "
                        f"docs/plugins.md)")


@functools.cache
def _load_builtins() -> None:
    """Imports every built-in method's module, once (each registers itself)."""
    for module in _BUILTINS:
        importlib.import_module(module)


def names() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def get(spec: str) -> type[Aggregation]:
    """The method class a spec (or a bare name) names."""
    name = options_lib.split(spec)[0]
    _load_builtins()
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
    what the run gives it besides (base.py's `cluster`, `between_workers`, `traffic`,
    `step_counter`; a compressor's `bucket_bytes`; local steps' `live`: between_nodes.make)."""
    method, options = parse(spec)
    return method(devices, options, transport_dtype, **construction)


def canonical_spec(spec: str) -> str:
    """NAME and the options that differ from their defaults, in field order."""
    return options_lib.format_spec(*parse(spec))


def describe(spec: str) -> dict[str, object]:
    """{'aggregation': NAME, 'aggregation/KEY': value, ...} of every option (defaults too)."""
    return options_lib.describe(*parse(spec))


from mgloop.aggregation import options as options_lib  # noqa: E402

# The built-in methods register themselves on import, loaded on the first lookup (so that a
# method's module imported first finds `register` here); in the order of docs/methods/.
_BUILTINS = (
    "mgloop.aggregation.dense.parameter_server",
    "mgloop.aggregation.dense.reduce_broadcast",
    "mgloop.aggregation.dense.ring",
    "mgloop.aggregation.dense.hierarchical",
    "mgloop.aggregation.dense.collective",
    "mgloop.aggregation.dense.independent",
    "mgloop.aggregation.local.local_steps",
    "mgloop.aggregation.local.des_loc",
    "mgloop.aggregation.local.streaming_diloco",
    "mgloop.aggregation.local.sparta",
    "mgloop.aggregation.local.noloco",
    "mgloop.aggregation.local.async_diloco",
    "mgloop.aggregation.local.sparseloco",
    "mgloop.aggregation.dense.stale",
    "mgloop.aggregation.dense.colocate",
    "mgloop.aggregation.dense.adasum",
    "mgloop.aggregation.robust.median",
    "mgloop.aggregation.robust.trimmed_mean",
    "mgloop.aggregation.robust.krum",
    "mgloop.aggregation.robust.bulyan",
    "mgloop.aggregation.robust.geomedian",
    "mgloop.aggregation.robust.centered_clipping",
    "mgloop.aggregation.compression.topk",
    "mgloop.aggregation.compression.randomk",
    "mgloop.aggregation.compression.threshold",
    "mgloop.aggregation.compression.dgc",
    "mgloop.aggregation.compression.qsgd",
    "mgloop.aggregation.compression.onebit",
    "mgloop.aggregation.compression.signs",
    "mgloop.aggregation.compression.powersgd",
    "mgloop.aggregation.compression.demo",
    "mgloop.aggregation.validation",
)


__all__ = ["Aggregation", "Capabilities", "Options", "option", "SHARED", "REPLICATED",
           "register", "names", "get", "parse", "make", "canonical_spec", "describe",
           "load_plugins"]
