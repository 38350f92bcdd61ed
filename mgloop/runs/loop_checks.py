"""The loop part's check (`config.loop`, runs/loop_options.py), which the gate
(runs/config_checks.py) calls before any device or variable exists. A module of its own, so
that loop_options.py holds data only (every part's check lives apart from its options).
"""

from __future__ import annotations

from mgloop import settings as settings_lib
from mgloop.runs.loop_options import MAX_SEED, LoopOptions


def check(options: LoopOptions, context: settings_lib.Context) -> LoopOptions:
    """--train_steps >= 0, --steps_per_loop >= 1, --checkpoint_every >= 0 (0: only at the
    end), --keep_checkpoints >= 1, a 32-bit --seed; returns `options` unchanged (the logdir
    is made, or checked creatable, after every part has passed: config_checks.py)."""
    settings_lib.in_range("train_steps", options.train_steps, low=0)
    settings_lib.in_range("steps_per_loop", options.steps_per_loop, low=1)
    settings_lib.in_range("checkpoint_every", options.checkpoint_every, low=0)
    settings_lib.in_range("keep_checkpoints", options.keep_checkpoints, low=1)
    settings_lib.in_range("seed", options.seed, low=0, high=MAX_SEED)
    return options
