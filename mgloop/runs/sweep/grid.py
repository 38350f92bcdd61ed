"""A grid of variants: `--vary` and `--set` as typed Config settings (mgloop.sweep, and
experiments/variants.py and experiments/traces.py overlap).

    --vary KEY=V1,V2,...        one axis: KEY takes each value in turn
    --vary K1/K2=A1/B1,A2/B2    one axis of tied keys: (K1, K2) = (A1, B1), then (A2, B2)
    --set KEY=VALUE             the same value in every variant

KEY is a field of mgloop.runs.config.Config; a value is parsed with the field's type
(read from its annotation by `typing.get_type_hints`: int, float, str, bool as
true/false, `none` for an optional field's None). The variants are the cross
product of the axes, in the order given (the last axis varies fastest); the
first is the baseline of the ratios. Values are separated by commas, or by
semicolons when the list holds one (for values with commas, e.g.
`--vary devices=gpu:0,1;gpu:0,1,2,3`); an aggregation spec's further options
stay with it (`--vary aggregation=ring:shards=2,chunks=4,ps_cpu` is two values:
a piece `key=value` after a spec continues that spec).

Every malformed item is refused with one line (SpecError) naming it and what
would be valid, before anything is built.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import types
import typing

_CONTINUES_SPEC = re.compile(r"[A-Za-z_]\w*=")  # "chunks=4" after "ring:shards=2"
SPEC_KEYS = ("aggregation",)  # values NAME:key=value,key=value


class SpecError(ValueError):
    """A --vary/--set/--plugin item the harness cannot use; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """One configuration to measure: its name, and the Config settings it gives."""

    name: str  # "aggregation=ring,pack_bytes=0" (the varied values, as given)
    varied: dict  # the varied keys' values
    settings: dict  # every given setting (--set and --vary), typed
    axes: tuple = ()  # ((keys, value text), ...) per --vary axis, in the grid's order


def field_types() -> dict[str, object]:
    """{setting: type} of every setting of mgloop.runs.config.Config (plain Python)."""
    from mgloop.runs.config import setting_types
    return setting_types()


def parse_value(key: str, text: str, kind) -> object:
    """`text` as a value of the Config field `key` of type `kind` (one-line SpecError)."""
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        choices = [k for k in typing.get_args(kind) if k is not type(None)]
        if text.strip().lower() == "none" and len(choices) < len(typing.get_args(kind)):
            return None
        kind = choices[0] if len(choices) == 1 else str
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "1", "yes"):
            return True
        if lowered in ("false", "0", "no"):
            return False
        raise SpecError(f"{key}: {text!r} is not a bool (true or false)")
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            raise SpecError(f"{key}: {text!r} is not {'an int' if kind is int else 'a float'}"
                            ) from None
    if kind is str:
        return text
    raise SpecError(f"{key}: a field of type {kind} cannot be varied here; give it as "
                    "the tool's own flag (e.g. --plugin, --link)")


def split_values(key: str, text: str) -> list[str]:
    """The values of one --vary item (see the top of this module)."""
    if ";" in text:
        return [piece for piece in text.split(";") if piece]
    pieces = text.split(",")
    if key not in SPEC_KEYS:
        return pieces
    values = []
    for piece in pieces:
        if values and ":" in values[-1] and _CONTINUES_SPEC.match(piece):
            values[-1] += "," + piece
        else:
            values.append(piece)
    return values


def _keys(item: str, flag: str, kinds: dict) -> tuple[list[str], str]:
    keys_text, sep, values_text = item.partition("=")
    keys = keys_text.split("/")
    if not sep or not values_text or not all(keys):
        raise SpecError(f"{flag} {item!r}: give KEY=VALUE (e.g. {flag} pack_bytes=0"
                        f"{',65536' if flag == '--vary' else ''})")
    for key in keys:
        if key not in kinds:
            raise SpecError(f"{flag} {key}: not a Config field; one of: "
                            f"{', '.join(sorted(kinds))}")
    return keys, values_text


def parse_vary(item: str, kinds: dict) -> tuple[list[str], list[tuple[tuple, str]]]:
    """(keys, [(typed values, text) per value]) of one --vary item."""
    keys, values_text = _keys(item, "--vary", kinds)
    out = []
    for text in split_values(keys[0] if len(keys) == 1 else "", values_text):
        parts = text.split("/") if len(keys) > 1 else [text]
        if len(parts) != len(keys):
            raise SpecError(f"--vary {'/'.join(keys)}: {text!r} does not give "
                            f"{len(keys)} values separated by / (e.g. cpu:1/ring)")
        try:
            out.append((tuple(parse_value(k, p, kinds[k]) for k, p in zip(keys, parts)), text))
        except SpecError as error:
            raise SpecError(f"--vary {error}") from None
    return keys, out


def variants(vary: list[str], fixed: list[str]) -> list[Variant]:
    """The cross product of the --vary axes, each with the --set settings."""
    kinds = field_types()
    settings, seen = {}, {}
    for item in fixed:
        (key,), text = _keys(item, "--set", kinds)
        try:
            settings[key] = parse_value(key, text, kinds[key])
        except SpecError as error:
            raise SpecError(f"--set {error}") from None
        seen[key] = "--set"
    axes = []
    for item in vary:
        keys, values = parse_vary(item, kinds)
        for key in keys:
            if key in seen:
                raise SpecError(f"--vary {key}: also given by {seen[key]}; give each key once")
            seen[key] = "--vary"
        axes.append((keys, values))
    out = []
    for choice in itertools.product(*[values for _, values in axes]):
        varied, names, pairs = {}, [], []
        for (keys, _), (typed, text) in zip(axes, choice):
            varied.update(zip(keys, typed))
            names.append(f"{'/'.join(keys)}={text}")
            pairs.append(("/".join(keys), text))
        out.append(Variant(",".join(names) or "default", varied, {**settings, **varied},
                           tuple(pairs)))
    names = [v.name for v in out]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise SpecError(f"--vary: {', '.join(repeated)} would run twice; give each value once")
    return out
