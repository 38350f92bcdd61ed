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

The search (`--tune_search`, `--tune_widen=W`; `walk` below):

    grid        every point of the cross product runs (at once, on the sweep's processes)
    coordinate  one axis at a time, in the order given: the other axes held at their
                current values (first the middle value of each axis, values[len // 2]),
                every value of the axis runs, the best is kept, then the next axis; the
                cells grow with the sum of the axes' lengths, not their product. One pass:
                the point chosen is the best of every point tried (each axis's line holds
                the best point of the lines before it), a coordinate-wise optimum of the
                grid, not necessarily the product's best
    widening    (either search) an axis whose best lies at its lowest or highest value
                gets one more value on that side, a geometric step beyond it,
                v_edge * (v_edge / v_next) (0.003, 0.01 -> 0.0333), and runs again, at most
                W times per axis and side; a value the cell's Config refuses (a momentum of
                1.01) ends the widening there, as does a value without a score. What stays at
                an edge after W widenings is marked `at_edge` as above

The points a search needs next are decided from the records on disk (`next_points`), so
a stopped sweep resumes where it stood and a re-run with a larger W runs only the new
points.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re

from mgloop.runs.sweep import grid

TUNING_SEED_BASE = 1000
SEARCHES = ("grid", "coordinate")
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
    from mgloop.runs.sweep import plan as plan_lib
    target = plan_lib.parse_target(target_text)
    if target is None:
        return "eval/loss", True
    return target.key, target.comparison != plan_lib.HIGHER


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


@dataclasses.dataclass(frozen=True)
class Walk:
    """Where a variant's search stands (`walk`)."""

    tried: list  # the points whose every tuning seed has a record, in the order reached
    pending: list  # the points the search needs next (a tuning seed without a record)
    chosen: tuple | None  # once nothing is pending: the point chosen (None: none scored)


def _widened(values: list[str], side: str) -> str | None:
    """One geometric step past the `side` edge of an axis of positive numbers,
    v_edge^2 / v_next as 3 significant digits (None: not positive numbers, fewer than two,
    or a step that rounds onto a value given)."""
    try:
        numbers = sorted(float(v) for v in values)
    except ValueError:
        return None
    if len(numbers) < 2 or numbers[0] <= 0:
        return None
    edge, nxt = (numbers[-1], numbers[-2]) if side == "highest" else (numbers[0], numbers[1])
    text = f"{edge * edge / nxt:.3g}"
    return None if float(text) in numbers else text


def walk(mine: list[Axis], score, lower: bool, search: str = "grid", widen: int = 0,
         allowed=lambda point: True) -> Walk:
    """The search of the module docstring over one variant's axes `mine`, replayed from
    what is known: `score(point)` is MISSING while a tuning seed of the point has no
    record, else the point's score (None: none); `allowed(point)` whether a widened point's
    Config is valid. Deterministic: the same records give the same walk."""
    values = {axis.key: list(axis.values) for axis in mine}
    widenings: dict[tuple, int] = {}
    tried: list[tuple] = []

    def point_at(current: dict) -> tuple:
        return tuple((axis.key, current[axis.key]) for axis in mine)

    def best_of(line: list[tuple]):
        """(pending points, best point or None) of one set of points run together."""
        known = {p: score(p) for p in line}
        for p in line:
            if known[p] is not MISSING and p not in tried:
                tried.append(p)
        pending = [p for p in line if known[p] is MISSING]
        scored = [p for p in line if known[p] is not MISSING and known[p] is not None]
        if pending or not scored:
            return pending, None
        return [], min(scored, key=lambda p: (known[p] if lower else -known[p],
                                              line.index(p)))

    def grow(key: str, best: tuple) -> bool:
        """Adds one value past the edge `best` lies at on axis `key`; True if it did."""
        at = at_edge([{"values": dict(p)} for p in [point_at({**dict(best), key: v})
                                                     for v in values[key]]], dict(best))
        side = at.get(key)
        if side is None or widenings.get((key, side), 0) >= widen:
            return False
        text = _widened(values[key], side)
        if text is None or not allowed(point_at({**dict(best), key: text})):
            return False
        widenings[(key, side)] = widenings.get((key, side), 0) + 1
        values[key].append(text)
        return True

    if search == "coordinate":
        current = {axis.key: axis.values[len(axis.values) // 2] for axis in mine}
        for axis in mine:
            while True:
                line = [point_at({**current, axis.key: v}) for v in values[axis.key]]
                pending, best = best_of(line)
                if best is None:
                    return Walk(tried, pending, None)
                current = dict(best)
                if not grow(axis.key, best):
                    break
        return Walk(tried, [], point_at(current))
    while True:
        line = [tuple(zip(values, combo)) for combo in itertools.product(*values.values())]
        pending, best = best_of(line)
        if best is None:
            return Walk(tried, pending, None)
        if not [key for key in values if grow(key, best)]:
            return Walk(tried, [], best)


def _records(plan, variant, point) -> list[dict]:
    from mgloop.runs.sweep import record as record_lib
    paths = [plan.result_path(cell) for cell in plan.tuning_cells_of(variant, point)]
    return [record_lib.read(p) for p in paths if os.path.exists(p)]


def walk_for(plan, variant) -> Walk | None:
    """The variant's search from its tuning records on disk (None: nothing to tune)."""
    from mgloop.errors import ConfigError
    mine = axes_of(plan._axes(), variant) if plan.tune else []
    if not mine:
        return None
    target = None if plan.target is None else str(plan.target)
    metric, lower = direction(target)

    def score(point):
        records = _records(plan, variant, point)
        if len(records) < len(plan.tune_seeds):
            return MISSING
        return summarise([(point, records)], target, plan.tune_seeds)["tried"][0]["score"]

    def allowed(point) -> bool:
        try:
            plan.config(plan.tuning_cells_of(variant, point)[0])
        except ConfigError:
            return False
        return True

    return walk(mine, score, lower, plan.tune_search, plan.tune_widen, allowed)


def next_points(plan, variant) -> list[tuple]:
    """The points the variant's search needs run next ([] once it has chosen)."""
    found = walk_for(plan, variant)
    return [] if found is None else found.pending


def order_of(plan, variant) -> list[tuple]:
    """The variant's points in the order its search reached them (a record's
    `tune_index` is its point's place here)."""
    found = walk_for(plan, variant)
    return [] if found is None else found.tried + found.pending


def summary_for(plan, variant) -> dict | None:
    """The variant's tuning summary from its tuning records on disk (None: no tuning):
    the points its search tried, in the order it reached them, and its choice."""
    found = walk_for(plan, variant)
    if found is None:
        return None
    tried = [(point, _records(plan, variant, point)) for point in found.tried]
    summary = summarise(tried, None if plan.target is None else str(plan.target),
                        plan.tune_seeds, chosen=found.chosen)
    return {**summary, "search": plan.tune_search, "widen": plan.tune_widen}


def chosen_point(plan, variant) -> tuple:
    """The point the variant's final seeds run at (() with nothing to tune); ConfigError
    (one line) when no point of its grid has a score."""
    summary = summary_for(plan, variant)
    if summary is None:
        return ()
    if summary["chosen"] is None:
        from mgloop.errors import ConfigError
        raise ConfigError(
            f"--tune: no point of variant {variant.name}'s tuning grid has a final "
            f"{summary['metric']} on every tuning seed {summary['seeds']} (each point has a "
            "seed that diverged or reported none), so none can be chosen and its final "
            "seeds are not run; give --tune values that train (--report_only: the tuning "
            "table)")
    return tuple(summary["chosen"].items())
