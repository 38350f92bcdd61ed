"""Tuning inside a sweep: `--tune=KEY=V1,V2,...` (repeatable) and `--tune_seeds=N`.

Per variant (a cell of the --vary grid), on its own:

    1. the tuning grid: the cross product of the --tune axes (in the order given, the
       last varying fastest), each point run on the tuning seeds
       TUNING_SEED_BASE + i, i = 0..N-1 (1000, 1001, ...): never one of the final seeds
       0..S-1, so the runs that choose are not the runs reported;
    2. the point with the best score (below), ties to the first in grid order;
    3. the final --seeds at the chosen point (the rows of the report).

KEY is a Config field (`learning_rate`, `momentum`, ...) with its values parsed as for
--vary (grid.py), or `aggregation.OPTION`, an option of the variant's --aggregation spec:
the value is written into the spec, so a variant `diloco:period=4` tuned with
`aggregation.outer_lr=0.5,0.7` runs `diloco:period=4,outer_lr=0.5` and `...,outer_lr=0.7`
(the method's own parser checks the value, aggregation/options.py). A variant whose
method has no such option does not tune that axis (its grid is the other axes'; the report
says so), so `--vary=aggregation=ring,diloco:period=4 --tune=aggregation.outer_lr=0.5,0.7`
tunes the outer learning rate of DiLoCo only; a variant with nothing to tune runs no tuning
cells. Refused (one line, before anything runs): a key that is neither, a key given twice
or also by --vary/--set, a spec that sets the tuned option itself, an option no variant's
method has.

Score of a point: the mean over its tuning seeds of the metric at each cell's last eval,

    score(p) = (1/N) sum_i m_i(p)      m: the --target's metric (its direction: `<=` lower
                                       is better, `>=` higher), else the eval loss, lowest

A point one of whose seeds diverged (NaN or infinite loss) or has no such metric has no
score, and is never chosen: the choice is among the points with a score. When no point of
a variant's grid has one, nothing is chosen (`chosen` None) and the variant's final seeds
are refused in one line (`chosen_point`), never run at a point picked without a value
(the sweep refuses, before anything runs, a --target metric that a cell does not report:
plan.eval_metrics). Tuning cells run their whole budget even with --stop_at_target, so
their final metrics compare at equal steps.

A chosen value at the lowest or highest value of its numeric axis is marked (`at_edge`:
in the record, the report's tuning table and the sweep's log): the best may lie outside
the grid, and the grid should be widened on that side.

The search, which points run (`--tune_search`, `--tune_widen`), is search.py's.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

from mgloop.runs.sweep import grid
from mgloop.runs.sweep import target as target_lib

TUNING_SEED_BASE = 1000
MISSING = object()  # a point a tuning seed of which has no record yet
OPTION_PREFIX = "aggregation."
_OPTION = re.compile(r"aggregation\.([A-Za-z_]\w*)$")


@dataclasses.dataclass(frozen=True)
class Axis:
    key: str  # "learning_rate" or "aggregation.outer_lr"
    values: tuple[str, ...]  # as typed

    @property
    def option(self) -> str | None:
        """The aggregation option an `aggregation.OPTION` key names, else None."""
        match = _OPTION.match(self.key)
        return match.group(1) if match else None


def tuning_seeds(count: int) -> tuple[int, ...]:
    return tuple(range(TUNING_SEED_BASE, TUNING_SEED_BASE + count))


def parse(items, kinds: dict) -> list[Axis]:
    """The --tune axes (one-line SpecError for a malformed one)."""
    axes = []
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or not text:
            raise grid.SpecError(f"--tune {item!r}: give KEY=V1,V2,... (e.g. --tune="
                                 "learning_rate=0.01,0.03 or --tune=aggregation.outer_lr=0.5,0.7)")
        if key not in kinds and not _OPTION.match(key):
            raise grid.SpecError(f"--tune {key}: neither a Config field nor aggregation.OPTION "
                                 "(an option of the variant's --aggregation spec)")
        if key in ("seed", "logdir"):
            raise grid.SpecError(f"--tune {key}: the sweep sets it (--seeds, --tune_seeds, "
                                 "--output_dir)")
        if any(axis.key == key for axis in axes):
            raise grid.SpecError(f"--tune {key}: given twice; give each key once")
        values = grid.split_values(key, text)
        if not all(values) or len(set(values)) != len(values):
            raise grid.SpecError(f"--tune {key}: {text!r}: give distinct values separated by "
                                 "commas")
        if key in kinds:
            for value in values:
                try:
                    grid.parse_value(key, value, kinds[key])
                except grid.SpecError as error:
                    raise grid.SpecError(f"--tune {error}") from None
        axes.append(Axis(key, tuple(values)))
    return axes


def _spec(variant) -> str:
    from mgloop.runs.config import Config
    return variant.settings.get("aggregation", Config().aggregation)


def _options_of(spec: str) -> tuple[str, list[str], set[str]]:
    """(method name, the spec's own key=value items, the method's option names)."""
    from mgloop import aggregation
    method = aggregation.get(spec)
    text = aggregation.options_lib.split(spec)[1]
    given = [part.strip() for part in text.split(",") if part.strip()] if text else []
    return method.name, given, {f.name for f in dataclasses.fields(method.options_type)}


def axes_of(axes: list[Axis], variant) -> list[Axis]:
    """The axes this variant tunes: every Config axis, and the aggregation options its
    method has (SpecError if the variant's --vary/--set gives a tuned key or its spec a
    tuned option)."""
    out = []
    for axis in axes:
        option = axis.option
        if option is None:
            if axis.key in variant.settings:
                raise grid.SpecError(f"--tune {axis.key}: also given by --vary or --set "
                                     f"(variant {variant.name}); give each key once")
            out.append(axis)
            continue
        name, given, options = _options_of(_spec(variant))
        if option not in options:
            continue
        if any(item.partition("=")[0].strip() == option for item in given):
            raise grid.SpecError(f"--tune {axis.key}: variant {variant.name} sets {option} "
                                 f"in its spec {_spec(variant)!r}; give it in one place")
        out.append(axis)
    return out


def check(axes: list[Axis], variants) -> None:
    """Every aggregation.OPTION axis is an option of some variant's method."""
    for axis in axes:
        if axis.option and not any(axis in axes_of(axes, v) for v in variants):
            methods = sorted({_options_of(_spec(v))[0] for v in variants})
            raise grid.SpecError(f"--tune {axis.key}: no variant's method has the option "
                                 f"{axis.option!r} (methods: {', '.join(methods)})")


def points(axes: list[Axis], variant) -> list[tuple]:
    """The variant's tuning grid: [((key, value text), ...) per point], grid order;
    [()] when it tunes nothing."""
    mine = axes_of(axes, variant)
    return [tuple(zip([a.key for a in mine], values))
            for values in itertools.product(*[a.values for a in mine])]


def text_of(point) -> str:
    return ",".join(f"{key}={value}" for key, value in point)


def settings_of(variant, point, kinds: dict) -> dict:
    """The Config settings of `variant` at `point`: typed Config fields, and the
    aggregation options appended to the variant's spec."""
    settings = dict(variant.settings)
    options = []
    for key, value in point:
        if key in kinds:
            settings[key] = grid.parse_value(key, value, kinds[key])
        else:
            options.append(f"{_OPTION.match(key).group(1)}={value}")
    if options:
        spec = _spec(variant)
        settings["aggregation"] = spec + ("," if ":" in spec else ":") + ",".join(options)
    return settings


def direction(target_text: str | None) -> tuple[str, bool]:
    """(metric key, lower is better) of the score: the target's, else eval/loss lowest."""
    target = target_lib.parse_target(target_text)
    if target is None:
        return "eval/loss", True
    return target.key, target.comparison != target_lib.HIGHER


def final_value(record: dict, metric: str):
    """The metric at the record's last eval (None: diverged or absent)."""
    if record.get("diverged") or not record["curve"]:
        return None
    return record["curve"][-1].get(metric)


def summarise(tried: list[tuple[tuple, list[dict]]], target_text: str | None,
              seeds, chosen: tuple | None = MISSING) -> dict:
    """From [(point, its tuning records)] in the order tried: what was tried, each
    point's score (module docstring) and the chosen point, as a record and the report hold
    it: the search's `chosen` where given (`walk`), else the best among the points with a
    score (ties to the first), None when none has one."""
    from mgloop.observe import stats
    metric, lower = direction(target_text)
    rows = []
    for point, records in tried:
        values = [final_value(r, metric) for r in records]
        finite = stats.finite(values)
        complete = len(records) == len(seeds) and len(finite) == len(values)
        rows.append({"values": dict(point), "scores": values,
                     "score": stats.mean_sd(finite)[0] if complete else None})
    scored = [i for i, row in enumerate(rows) if row["score"] is not None]
    if chosen is not MISSING:
        chosen = None if chosen is None else dict(chosen)
    elif not scored:
        chosen = None
    else:
        best = min(scored, key=lambda i: (rows[i]["score"] if lower else -rows[i]["score"], i))
        chosen = rows[best]["values"]
    return {"metric": metric, "lower_is_better": lower, "seeds": list(seeds), "tried": rows,
            "chosen": chosen, "at_edge": at_edge(rows, chosen)}


def at_edge(rows: list[dict], chosen: dict | None) -> dict[str, str]:
    """{key: "lowest" | "highest"} for each numeric axis of 2+ values whose chosen value is
    the lowest or highest the grid tried: the best may lie outside the grid, so a reviewer
    asks for it widened (the report and the sweep's log say so). Axes whose values are not
    all numbers (a method's name, a format) have no edge."""
    if chosen is None:
        return {}
    edges = {}
    for key, value in chosen.items():
        numbers = []
        for text in dict.fromkeys(row["values"][key] for row in rows if key in row["values"]):
            try:
                numbers.append(float(text))
            except (TypeError, ValueError):
                break
        else:
            if len(numbers) >= 2 and float(value) in (min(numbers), max(numbers)):
                edges[key] = "lowest" if float(value) == min(numbers) else "highest"
    return edges
