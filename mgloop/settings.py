"""What a setting is: a `Config` field with its help line beside it, and the checks with
which each module refuses its own bad settings.

`setting(default, help, ...)` is a `dataclasses.field` whose metadata holds what the
flags (flags.py) and the HParams record (summaries.py) need:

    help     the flag's help line; `{choices}` in it is replaced by the choices
    choices  the valid values of an enum-like string (a tuple); a setting whose values a
             registry holds (--aggregation, --dataset, --model) has none here: the flags
             (flags.py) read the registry's names where they are made
    flag     the flag's name when it is not the field's (a repeatable `--plugin` fills
             the field `plugins`)
    hparam   True: the setting can change a result (the trained variables, the loss, a
             metric), so every run records it in its HParams session;
    neutral  otherwise, the reason why it cannot (it only says where files go, how often
             something is written, how long to wait...). Each setting states one of the two.

An entry point's own settings (`python -m mgloop.launch`, `mgloop.sweep`: cluster/
launch_options.py, runs/sweep/options.py) are not a run's, so neither applies: they are
`entry_setting(default, help, flag=...)`s, made into flags by the same rules (flags.py).

This module imports no TensorFlow and nothing of mgloop but errors.py, so every module
may check its settings with `choice` and `in_range` without an import cycle.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import typing
from typing import Callable, Iterable

from mgloop.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Context:
    """What a package's `check(options, context)` may know of the run beyond its own part of
    the settings: facts that runs/config_checks.py works out before the parts are checked,
    one per field, so that no package reads another's options.

    request: cluster.devices.Request: the parsed --devices x --towers_per_device (one worker)
    workers: cluster.workers.Cluster | None: the TF_CONFIG job, if any
    num_workers, num_towers: workers, and towers over all workers
    devices_flag: how the towers were asked for, e.g. "cpu:4 on each of 2 workers" (messages)
    seed, deterministic: --seed and --deterministic (the loop's)
    """

    request: object = None
    workers: object = None
    num_workers: int = 1
    num_towers: int = 1
    devices_flag: str = ""
    seed: int = 0
    deterministic: bool = False


def setting(default, help: str, *, hparam: bool = False, neutral: str | None = None,
            choices: Iterable[str] | Callable[[], Iterable[str]] | None = None,
            flag: str | None = None):
    """A Config field with its help line; give `hparam=True` or `neutral="why not"`."""
    if hparam == (neutral is not None):
        raise TypeError("a setting is either hparam=True (it can change a result) or "
                        "neutral='why it cannot', not both or neither")
    return dataclasses.field(default=default, metadata={
        "help": help, "hparam": hparam, "neutral": neutral, "choices": choices, "flag": flag})


def entry_setting(default, help: str, *, flag: str | None = None,
                  choices: Iterable[str] | None = None):
    """An entry point's own setting (launch's, sweep's) with its help line: not recorded in
    a run's HParams, so it states neither `hparam` nor `neutral`."""
    return dataclasses.field(default=default, metadata={
        "help": help, "hparam": False, "neutral": None, "choices": choices, "flag": flag,
        "entry": True})


def choices_of(field: dataclasses.Field) -> tuple[str, ...] | None:
    choices = field.metadata.get("choices")
    if choices is None:
        return None
    return tuple(choices() if callable(choices) else choices)


def help_of(field: dataclasses.Field, choices: Iterable[str] | None = None) -> str:
    """The field's help line, its `{choices}` filled in (from `choices`, a registry's names,
    where given, else the field's own)."""
    choices = tuple(choices) if choices is not None else choices_of(field)
    text = field.metadata["help"]
    return text.format(choices=", ".join(choices)) if choices is not None else text


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or field.name


def hparam_names(fields: Iterable[dataclasses.Field]) -> tuple[str, ...]:
    """The settings among `fields` that can change a result (`hparam=True`), in order."""
    return tuple(f.name for f in fields if f.metadata.get("hparam"))


def choice(flag: str, value: str, choices: Iterable[str]) -> None:
    """Refuses `value` outside `choices`, in one line naming `--flag` and the choices."""
    choices = list(choices)
    if value not in choices:
        raise ConfigError(f"--{flag}={value!r} is not one of: {', '.join(sorted(choices))}")


def in_range(flag: str, value, low=None, high=None, low_open=False, high_open=False) -> None:
    """`value` within the bounds; NaN and inf are refused before, for every float field
    (`Config.validated`), as they pass every comparison."""
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        bounds = []
        if low is not None:
            bounds.append(f"{'>' if low_open else '>='} {low}")
        if high is not None:
            bounds.append(f"{'<' if high_open else '<='} {high}")
        raise ConfigError(f"--{flag}={value} is out of range: must be {' and '.join(bounds)}")


def check_finite(options) -> None:
    """Refuses NaN and inf in every float field of a settings part (a frozen dataclass of
    `setting`s): they pass every comparison; and in every integer field (`int` or
    `int | None`) a value that is no integer (1.5, True), which the flags cannot give but
    the Python API can, and which would pass the range checks."""
    types = typing.get_type_hints(type(options))  # the annotations resolved, as the flags'
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"--{flag_name(field)}={value} is not a finite number; give a "
                              "finite one")
        if (types[field.name] in (int, int | None) and value is not None
                and (isinstance(value, bool) or not isinstance(value, numbers.Integral))):
            raise ConfigError(f"--{flag_name(field)}={value!r} is not an integer; give a "
                              "whole number")
