"""absl flag definitions made from settings' fields; nothing else in mgloop defines flags.

`define_flags_of(options_type)` registers one flag per field of a frozen dataclass of
settings (settings.py `setting`, `entry_setting`), made from the field alone: its name (or
the `flag` of its metadata), default, help line and type, read from the resolved
annotation (`typing.get_type_hints`):

    bool -> DEFINE_bool    int, int | None -> DEFINE_integer    float -> DEFINE_float
    str, str | None -> DEFINE_string    tuple[str, ...] -> DEFINE_multi_string (repeatable)

`options_from_flags(options_type)` reads them back into one object. `mgloop.train`'s
flags are Config's parts' (`define_flags()`, `config_from_flags()`); `mgloop.launch`'s are
cluster/launch_options.py's, `mgloop.sweep`'s runs/sweep/options.py's.

Enum-like strings stay strings (their choices are in the help): each part's check refuses
a bad value (`Config.validated()`, launch's and sweep's `check`), so the CLI and the Python
API give the same errors. The choices a registry holds (--aggregation, --dataset, --model:
plugins' included) are read here, where the flags are made (`help_of`), so that the
options modules stay data only.

A flag two entry points' options both hold with the same type and default (train's and
sweep's --plugin and --link) is defined once and shared, not refused as a duplicate when
both sets are defined in one process (tests): a process parses one command line.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing

from absl import flags

from mgloop import settings
from mgloop.runs.config import PARTS, Config, setting_fields

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


def define_flags_of(options_type: type, module_name: str | None = None,
                    help_of: typing.Callable = settings.help_of) -> None:
    """Defines one flag per field of `options_type`, once. `module_name`: the module whose
    `--help` lists them (an entry point's `__name__`; default: this one's, so `--helpfull`
    lists them); `help_of(field)`: the flag's help line."""
    if module_name == "__main__":
        module_name = sys.argv[0]  # the name absl's --help gives the main module
    hints = typing.get_type_hints(options_type)
    for field in dataclasses.fields(options_type):
        define = define_function(hints[field.name])
        name = settings.flag_name(field)
        default = list(field.default) if isinstance(field.default, tuple) else field.default
        if name in FLAGS:
            probe = flags.FlagValues()
            define(name, default, help_of(field), flag_values=probe)
            if _same_kind(FLAGS[name], probe[name]):
                continue  # shared (see the module docstring)
        define(name, default, help_of(field), module_name=module_name)


def _same_kind(defined: flags.Flag, new: flags.Flag) -> bool:
    return (type(defined) is type(new) and type(defined.parser) is type(new.parser)
            and defined.default == new.default)


def options_from_flags(options_type: type):
    """The options object of the flags' values (define_flags_of's, once parsed)."""
    return options_type(**_values(dataclasses.fields(options_type)))


def _values(fields) -> dict[str, object]:
    values = {}
    for field in fields:
        value = FLAGS[settings.flag_name(field)].value
        values[field.name] = tuple(value or ()) if isinstance(field.default, tuple) else value
    return values


def define_flags() -> None:
    """Defines one flag per Config field, once (mgloop.train's)."""
    if "aggregation" in FLAGS:
        return
    for part in PARTS.values():
        define_flags_of(part, help_of=help_of)


def help_of(field) -> str:
    """The flag's help line of a Config field, `{choices}` filled in: a registry's names
    (the methods, the datasets, the models registered when it is called) or the field's."""
    from mgloop import aggregation, data, models  # their bodies load on the call (TensorFlow)
    registries = {"aggregation": aggregation, "dataset": data, "model": models}
    registry = registries.get(field.name)
    return settings.help_of(field, registry.names() if registry is not None else None)


def config_from_flags() -> Config:
    return Config(**_values(setting_fields()))
