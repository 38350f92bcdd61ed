"""Which tuning points run, and the choice (`--tune_search`, `--tune_widen`; the axes,
the points' settings and the score are tune.py's).

    grid        every point of the cross product runs (at once, on the sweep's processes)
    coordinate  one axis at a time, in the order given: the other axes held at their
                current values (first the middle value of each axis, values[len // 2]),
                every value of the axis runs, the best is kept, then the next axis; the
                cells grow with the sum of the axes' lengths, not their product. One pass:
                the point chosen is the best of every point tried (each axis's line holds
                the best point of the lines before it), a coordinate-wise optimum of the
                grid, not necessarily the product's best. With P passes
                (`--tune_passes=P`) the axes are gone over again from the point the last
                pass chose, each line running only its points not yet run: an axis tuned
                first at the others' middle values (an outer rate where a method is
                unstable pulls its inner rate down) is tuned again at their best
    widening    (either search) an axis whose best lies at its lowest or highest value
                gets one more value on that side, a geometric step beyond it,
                v_edge * (v_edge / v_next) (0.003, 0.01 -> 0.0333), and runs again, at most
                W times per axis and side. Where the cell's Config refuses that step up
                and the axis lies in (0, 1) (a momentum or a decay below 1: 0.9, 0.95 ->
                1.003), the step is geometric in 1 - v instead (0.9, 0.95 -> 0.975, then
                0.9875). A value the Config refuses ends the widening there, as does a
                value without a score. What stays at an edge after W widenings is marked
                (tune.at_edge)

The points a search needs next are decided from the records on disk (`next_points`), so
a stopped sweep resumes where it stood and a re-run with a larger W runs only the new
points.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

from mgloop.runs.sweep.options import TUNE_SEARCHES
from mgloop.runs.sweep.tune import MISSING, Axis, at_edge, axes_of, direction, summarise

SEARCHES = TUNE_SEARCHES  # --tune_search (options.py)


@dataclasses.dataclass(frozen=True)
class Walk:
    """Where a variant's search stands (`walk`)."""

    tried: list  # the points whose every tuning seed has a record, in the order reached
    pending: list  # the points the search needs next (a tuning seed without a record)
    chosen: tuple | None  # once nothing is pending: the point chosen (None: none scored)
    reached: list = dataclasses.field(default_factory=list)  # every point of the lines
    # formed so far, in line order: stable while the points' cells finish in any order


def _widened(values: list[str], side: str) -> list[str]:
    """The values one step past the `side` edge of an axis of positive numbers, in the
    order to try: v_edge^2 / v_next, and on the highest side of an axis in (0, 1) where
    that reaches 1, 1 - (1 - v_edge)^2 / (1 - v_next) (geometric in 1 - v); each as 3
    significant digits (of 1 - v for the second). None of them: not positive numbers,
    fewer than two, or a step that rounds onto a value given."""
    try:
        numbers = sorted(float(v) for v in values)
    except ValueError:
        return []
    if len(numbers) < 2 or numbers[0] <= 0:
        return []
    edge, nxt = (numbers[-1], numbers[-2]) if side == "highest" else (numbers[0], numbers[1])
    texts = [f"{edge * edge / nxt:.3g}"]
    if side == "highest" and numbers[-1] < 1 <= edge * edge / nxt:
        texts.append(f"{1 - float(f'{(1 - edge) ** 2 / (1 - nxt):.3g}'):.10g}")
    return [text for text in texts if float(text) not in numbers]


def walk(mine: list[Axis], score, lower: bool, search: str = "grid", widen: int = 0,
         allowed=lambda point: True, passes: int = 1) -> Walk:
    """The search of the module docstring over one variant's axes `mine`, replayed from
    what is known: `score(point)` is MISSING while a tuning seed of the point has no
    record, else the point's score (None: none); `allowed(point)` whether a widened point's
    Config is valid. Deterministic: the same records give the same walk."""
    values = {axis.key: list(axis.values) for axis in mine}
    widenings: dict[tuple, int] = {}
    known: dict[tuple, object] = {}
    reached: list[tuple] = []

    def stands(pending, chosen) -> Walk:
        tried = [p for p in reached if known[p] is not MISSING]
        return Walk(tried, pending, chosen, list(reached))

    def point_at(current: dict) -> tuple:
        return tuple((axis.key, current[axis.key]) for axis in mine)

    def best_of(line: list[tuple]):
        """(pending points, best point or None) of one set of points run together."""
        for p in line:
            if p not in known:
                known[p] = score(p)
                reached.append(p)
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
        text = next((t for t in _widened(values[key], side)
                     if allowed(point_at({**dict(best), key: t}))), None)
        if text is None:
            return False
        widenings[(key, side)] = widenings.get((key, side), 0) + 1
        values[key].append(text)
        return True

    if search == "coordinate":
        current = {axis.key: axis.values[len(axis.values) // 2] for axis in mine}
        for axis in [axis for _ in range(passes) for axis in mine]:
            while True:
                line = [point_at({**current, axis.key: v}) for v in values[axis.key]]
                pending, best = best_of(line)
                if best is None:
                    return stands(pending, None)
                current = dict(best)
                if not grow(axis.key, best):
                    break
        return stands([], point_at(current))
    while True:
        line = [tuple(zip(values, combo)) for combo in itertools.product(*values.values())]
        pending, best = best_of(line)
        if best is None:
            return stands(pending, None)
        if not [key for key in values if grow(key, best)]:
            return stands([], best)


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

    return walk(mine, score, lower, plan.tune_search, plan.tune_widen, allowed,
                plan.tune_passes)


def least_tuning_cells(plan) -> int:
    """The fewest tuning cells the search runs before any widening: the grid's; for the
    coordinate search, per variant, sum of its axes' lengths - (axes - 1) points (each
    line after the first holds the best point of the one before) on every tuning seed."""
    if plan.tune_search == "grid":
        return len(plan.tuning_cells())
    lines = [axes_of(plan._axes(), v) for v in plan.variants()] if plan.tune else []
    return len(plan.tune_seeds) * sum(sum(len(a.values) for a in axes) - len(axes) + 1
                                      for axes in lines if axes)


def next_points(plan, variant) -> list[tuple]:
    """The points the variant's search needs run next ([] once it has chosen)."""
    found = walk_for(plan, variant)
    return [] if found is None else found.pending


def order_of(plan, variant) -> list[tuple]:
    """The variant's points in the order its search reached them, each line in its own
    order whatever order its cells finish in (a record's `tune_index` is its point's
    place here)."""
    found = walk_for(plan, variant)
    return [] if found is None else found.reached


def summary_for(plan, variant) -> dict | None:
    """The variant's tuning summary from its tuning records on disk (None: no tuning):
    the points its search tried, in the order it reached them, and its choice."""
    found = walk_for(plan, variant)
    if found is None:
        return None
    tried = [(point, _records(plan, variant, point)) for point in found.tried]
    summary = summarise(tried, None if plan.target is None else str(plan.target),
                        plan.tune_seeds, chosen=found.chosen)
    return {**summary, **searched(plan)}


def searched(plan) -> dict:
    """How the search ran, as records keep it: the search, its widening and (if more than
    one) its passes."""
    passes = {"passes": plan.tune_passes} if plan.tune_passes > 1 else {}
    return {"search": plan.tune_search, "widen": plan.tune_widen, **passes}


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
