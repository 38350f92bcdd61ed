"""The sweep's check of its own settings (options.py), made while nothing exists yet: no
output folder, no cell, TensorFlow not loaded. A module of its own, so that options.py holds
data only (as every part's check lives apart from its options). What needs the cells'
settings (--vary, --set, --tune, --target's metric, --panels) is checked by plan.py, grid.py,
tune.py and mgloop/sweep.py once the plan is made.
"""

from __future__ import annotations

from mgloop.errors import ConfigError
from mgloop.runs.sweep.options import TUNE_SEARCHES, SweepOptions
from mgloop.settings import choice, in_range


def check(options: SweepOptions) -> SweepOptions:
    """Refuses, in one line naming the flag and what is valid: no --output_dir, counts out
    of range (--seeds, --evals, --tune_seeds, --tune_passes, --processes >= 1; --tune_widen,
    --cells_per_process >= 0), --tune_search not grid or coordinate, --stop_at_target
    without --target. Returns the options unchanged."""
    if not options.output_dir:
        raise ConfigError("--output_dir is not set; give the folder for the runs, records "
                          "and report")
    in_range("seeds", options.seeds, low=1)
    in_range("evals", options.evals, low=1)
    in_range("tune_seeds", options.tune_seeds, low=1)
    choice("tune_search", options.tune_search, TUNE_SEARCHES)
    in_range("tune_widen", options.tune_widen, low=0)
    in_range("tune_passes", options.tune_passes, low=1)
    in_range("processes", options.processes, low=1)
    in_range("cells_per_process", options.cells_per_process, low=0)
    if options.stop_at_target and options.target is None:
        raise ConfigError("--stop_at_target needs --target=METRIC>=VALUE")
    return options
