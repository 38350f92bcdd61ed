"""absl flag definitions for every Config field; nothing else in mgloop defines flags.

`define_flags()` registers one flag per setting of Config's parts (config.py), made from the
field alone: its name (or the `flag` of its metadata), default, help line (settings.py) and
type, read from the resolved annotation (`typing.get_type_hints`):

    bool -> DEFINE_bool    int, int | None -> DEFINE_integer    float -> DEFINE_float
    str, str | None -> DEFINE_string    tuple[str, ...] -> DEFINE_multi_string (repeatable)

Enum-like strings stay strings (their choices are in the help): `Config.validated()`
checks every value, so the CLI and the Python API give the same errors. The choices a
registry holds (--aggregation, --dataset, --model: plugins' included) are read here, where
the flags are made (`help_of`), so that the options modules stay data only.
`config_from_flags()` reads the flags back into a Config.
"""

from __future__ import annotations

import types
import typing

from absl import flags

from mgloop import settings
from mgloop.runs.config import Config, setting_fields, setting_types

FLAGS = flags.FLAGS

_DEFINE = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, float: flags.DEFINE_float,
           str: flags.DEFINE_string}


def define_function(annotation) -> typing.Callable:
    """The absl DEFINE_* of a field's resolved type annotation (`X | None` as X)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return define_function(args[0])
    elif typing.get_origin(annotation) is tuple and typing.get_args(annotation) == (str, ...):
        return flags.DEFINE_multi_string
    elif annotation in _DEFINE:
        return _DEFINE[annotation]
    raise TypeError(f"no flag type for a setting annotated {annotation!r}")


def define_flags() -> None:
    """Defines one flag per Config field, once."""
    if "aggregation" in FLAGS:
        return
    hints = setting_types()
    for field in setting_fields():
        define = define_function(hints[field.name])
        default = list(field.default) if isinstance(field.default, tuple) else field.default
        define(settings.flag_name(field), default, help_of(field))


def help_of(field) -> str:
    """The flag's help line of a Config field, `{choices}` filled in: a registry's names
    (the methods, the datasets, the models registered when it is called) or the field's."""
    from mgloop import aggregation, data, models  # their bodies load on the call (TensorFlow)
    registries = {"aggregation": aggregation, "dataset": data, "model": models}
    registry = registries.get(field.name)
    return settings.help_of(field, registry.names() if registry is not None else None)


def config_from_flags() -> Config:
    values = {}
    for field in setting_fields():
        value = FLAGS[settings.flag_name(field)].value
        values[field.name] = tuple(value or ()) if isinstance(field.default, tuple) else value
    return Config(**values)
