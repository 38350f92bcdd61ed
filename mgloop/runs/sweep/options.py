"""The sweep's own settings (`python -m mgloop.sweep`, mgloop/sweep.py): `SweepOptions`.

Data only, plain Python (no TensorFlow): the sweep's flags are made from these fields
(runs/flags.py `define_flags_of`, the rules `mgloop.train`'s flags follow) and read back
into one `SweepOptions`, from which the plan is made (plan.py); checks.py refuses values
out of range before any folder is made or TensorFlow loads. A repeatable flag fills a
tuple field (`--link` fills `links`, `--plugin` fills `plugins`, as in `Config`).
"""

from __future__ import annotations

import dataclasses

from mgloop.settings import entry_setting

TUNE_SEARCHES = ("grid", "coordinate")  # --tune_search (search.py runs each)


@dataclasses.dataclass(frozen=True)
class SweepOptions:
    """A study: its grid, budget, target, tuning, links, where it goes and how it runs."""

    vary: tuple[str, ...] = entry_setting((), "KEY=V1,V2,...: an axis of the grid")
    set: tuple[str, ...] = entry_setting((), "KEY=VALUE: a setting of every cell")
    seeds: int = entry_setting(3, "seeds 0..N-1 per variant")
    epochs: float | None = entry_setting(None, "budget: passes over the training data")
    evals: int = entry_setting(20, "evaluations over the budget")
    target: str | None = entry_setting(
        None, "METRIC>=VALUE or METRIC<=VALUE (an eval metric)")
    tune: tuple[str, ...] = entry_setting(
        (), "KEY=V1,V2,...: a tuning axis (KEY a Config field or aggregation.OPTION)")
    tune_seeds: int = entry_setting(1, "tuning seeds per point (1000, 1001, ...)")
    tune_search: str = entry_setting(
        "grid", "grid: every point of the --tune axes' product; coordinate: one "
        "axis at a time, the others at their best so far", choices=TUNE_SEARCHES)
    tune_widen: int = entry_setting(
        0, "values added past a tuning axis's edge when its best lies there, per axis and "
        "side")
    tune_passes: int = entry_setting(
        1, "coordinate search: passes over the axes, each from the point the last chose")
    panels: str | None = entry_setting(None, "a --vary axis: one plot panel per value of it")
    stop_at_target: bool = entry_setting(
        False, "end a cell at its first eval meeting --target")
    links: tuple[str, ...] = entry_setting(
        (), "[within:|between:]BANDWIDTH,LATENCY to model", flag="link")
    plugins: tuple[str, ...] = entry_setting(
        (), "module of user methods/datasets (every cell)", flag="plugin")
    output_dir: str | None = entry_setting(
        None, "where runs/, results/, report.md and plots/ go")
    processes: int = entry_setting(1, "cells at once")
    cells_per_process: int = entry_setting(
        4, "a fresh worker process after N cells (0: never, and with --processes=1 the cells "
        "run in this process)")
    report_only: bool = entry_setting(False, "only rewrite the report from the records")
    title: str | None = entry_setting(
        None, "the report's title (default: the output folder's name)")
