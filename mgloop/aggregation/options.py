"""A method and its options as one string: `NAME` or `NAME:key=value,key=value`.

`--aggregation=ring:shards=2`, `Config(aggregation="hierarchical:groups=2")`: the
part before `:` names a registered method; each `key=value` sets one field of the
method's frozen options dataclass (`Aggregation.options_type`), converted to the
field's type (int, float, bool, str) and checked against the range or choices in
its metadata (`base.option`). Omitted keys keep their defaults. Every mistake is
one ConfigError line naming the method, the key and what is valid.
"""

from __future__ import annotations

import dataclasses
import math
import typing

from mgloop.aggregation.base import Aggregation, Options
from mgloop.errors import ConfigError

_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def split(spec: str) -> tuple[str, str]:
    """`NAME:options` -> (NAME, options); `NAME` -> (NAME, "")."""
    if not isinstance(spec, str):
        raise ConfigError(f"--aggregation={spec!r} is not a string NAME or NAME:key=value,...")
    name, _, text = spec.strip().partition(":")
    return name.strip(), text.strip()


def field_types(options_type: type[Options]) -> dict[str, type]:
    """Each field's type, resolved (the annotations may be strings)."""
    hints = typing.get_type_hints(options_type)
    return {f.name: hints[f.name] for f in dataclasses.fields(options_type)}


def describe_field(options_type: type[Options], field: dataclasses.Field) -> str:
    """'shards (int >= 1, default 1): parallel rings ...'"""
    kind = field_types(options_type)[field.name]
    meta = field.metadata
    valid = _valid_text(meta)
    return (f"{field.name} ({getattr(kind, '__name__', kind)}{' ' + valid if valid else ''}, "
            f"default {field.default}): {meta.get('help', '')}")


def _valid_text(meta) -> str:
    if meta.get("choices"):
        return "one of " + "|".join(map(str, meta["choices"]))
    bounds = []
    if meta.get("low") is not None:
        bounds.append(f"{'>' if meta.get('low_open') else '>='} {meta['low']}")
    if meta.get("high") is not None:
        bounds.append(f"{'<' if meta.get('high_open') else '<='} {meta['high']}")
    return " and ".join(bounds)


def parse_options(method: type[Aggregation], text: str, spec: str) -> Options:
    """The options instance of `method` that `text` ("key=value,...") sets."""
    options_type = method.options_type
    fields = {f.name: f for f in dataclasses.fields(options_type)}
    types = field_types(options_type)
    where = f"--aggregation={spec}"
    valid_keys = ("; its options: " + "; ".join(describe_field(options_type, f)
                                                   for f in fields.values())
                  if fields else f"; {method.name} takes no options")
    values = {}
    for item in filter(None, (part.strip() for part in text.split(","))) if text else ():
        key, equals, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not equals or key not in fields:
            what = f"has no option {key!r}" if equals else f"option {item!r} is not key=value"
            raise ConfigError(f"{where}: {method.name} {what}{valid_keys}")
        if key in values:
            raise ConfigError(f"{where}: {method.name} option {key} is given twice; "
                              "give each option once")
        values[key] = _convert(method, fields[key], types[key], raw, where)
    return options_type(**values)


def _convert(method, field, kind, raw: str, where: str):
    meta = field.metadata
    try:
        if kind is bool:
            if raw.lower() not in _TRUE + _FALSE:
                raise ValueError(raw)
            value = raw.lower() in _TRUE
        else:
            value = kind(raw)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(raw)
    except ValueError:
        raise ConfigError(f"{where}: {method.name} option {field.name}={raw!r} is not "
                          f"{_a(getattr(kind, '__name__', str(kind)))}; "
                          f"{describe_field(method.options_type, field)}") from None
    choices, low, high = meta.get("choices"), meta.get("low"), meta.get("high")
    too_low = low is not None and (value <= low if meta.get("low_open") else value < low)
    too_high = high is not None and (value >= high if meta.get("high_open") else value > high)
    if (choices and value not in choices) or too_low or too_high:
        raise ConfigError(f"{where}: {method.name} option {field.name}={raw} is out of range: "
                          f"must be {_valid_text(meta)}")
    return value


def format_spec(method: type[Aggregation], options: Options) -> str:
    """The canonical spec: NAME, then every option that differs from its default."""
    changed = [f"{f.name}={_text(getattr(options, f.name))}"
               for f in dataclasses.fields(options)
               if getattr(options, f.name) != f.default]
    return method.name + (":" + ",".join(changed) if changed else "")


def describe(method: type[Aggregation], options: Options) -> dict[str, object]:
    """{'aggregation': NAME, 'aggregation/KEY': value for every option, defaults included}:
    what the HParams record of a run holds about its method."""
    out: dict[str, object] = {"aggregation": method.name}
    for f in dataclasses.fields(options):
        out[f"aggregation/{f.name}"] = getattr(options, f.name)
    return out


def _a(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def _text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
