"""The step part's check (`config.step`, step/options.py), which the gate
(runs/config_checks.py) calls before any device or variable exists.

A module of its own, so that options.py stays data only: the checks it calls live beside
what they refuse (compiled_towers.py, vectorized_towers.py, hooks/attacks.py), which import
options.py, never the other way round.
"""

from __future__ import annotations

from mgloop.settings import Context, choice, in_range
from mgloop.step import compiled_towers, vectorized_towers
from mgloop.step.hooks import attacks
from mgloop.step.options import BATCH_NORM_MODES, POLICIES, StepOptions


def check(options: StepOptions, context: Context) -> StepOptions:
    """Refuses (one line) step settings that no run can use: K = the towers per device
    (context.request) vectorized or --xla_towers with a hook inside a tower's pass, a bad
    attack, an out-of-range count or size; returns `options` unchanged. What depends on
    the method or the nodes is checked beside it (runs/config_checks.py: `check_method` of
    vectorized_towers and compiled_towers, attacks.check_units)."""
    towers_per_device = (context.request.towers_per_device if context.request is not None
                         else 1)
    vectorized_towers.check_step(options, towers_per_device)
    compiled_towers.check_step(options, towers_per_device)
    attacks.check_options(options)
    in_range("accumulation_steps", options.accumulation_steps, low=1)
    choice("mixed_precision", options.mixed_precision, POLICIES)
    choice("batch_norm", options.batch_norm, BATCH_NORM_MODES)
    in_range("ordered_sum_bytes", options.ordered_sum_bytes, low=0)
    in_range("sufficient_factor_bytes", options.sufficient_factor_bytes, low=0)
    return options
