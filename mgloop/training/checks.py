"""The optimizer part's checks (`config.optim`, training/options.py): `check`, which the
gate (runs/config_checks.py) calls before any device or variable exists, and the
combinations the gate calls after it (`check_shard_update`, `check_warmup`). A module of
its own, so that options.py holds data only (every part's check lives apart from its
options).
"""

from __future__ import annotations

from mgloop.errors import ConfigError
from mgloop.settings import Context, choice, in_range
from mgloop.training.options import LR_SCHEDULES, MUON_DEFAULTS, OPTIMIZERS, OptimOptions


def check(options: OptimOptions, context: Context) -> OptimOptions:
    """--optimizer, its rate and schedule, each in its range; returns `options` unchanged.
    The warm-up against the run's length: `check_warmup`."""
    choice("optimizer", options.optimizer, OPTIMIZERS)
    choice("lr_schedule", options.lr_schedule, LR_SCHEDULES)
    in_range("learning_rate", options.learning_rate, low=0.0, low_open=True)
    in_range("momentum", options.momentum, low=0.0, high=1.0, high_open=True)
    in_range("lr_power", options.lr_power, low=0.0, low_open=True)
    in_range("weight_decay", options.weight_decay, low=0.0)
    in_range("adam_epsilon", options.adam_epsilon, low=0.0, low_open=True)
    in_range("warmup_steps", options.warmup_steps, low=0)
    in_range("muon_adam_lr_ratio", options.muon_adam_lr_ratio, low=0.0, low_open=True)
    in_range("muon_rms_rate", options.muon_rms_rate, low=0.0)
    muon_settings = {"muon_adam_lr_ratio": options.muon_adam_lr_ratio,
                     "muon_rms_rate": options.muon_rms_rate}
    for name, value in muon_settings.items():  # set for another optimizer: it means nothing
        if options.optimizer != "muon" and value != MUON_DEFAULTS[name]:
            raise ConfigError(f"--{name}={value} is a setting of --optimizer=muon; leave it "
                              f"out with --optimizer={options.optimizer}")
    return options


def check_shard_update(options: OptimOptions, shard_update: bool) -> None:
    """--shard_update updates a chunk of each variable apart, and muon orthogonalises whole
    matrices (a chunk's orthogonalisation is not the matrix's): refused together."""
    if shard_update and options.optimizer == "muon":
        raise ConfigError("--shard_update with --optimizer=muon: each copy would update a "
                          "chunk of a matrix, and Muon orthogonalises whole matrices (a "
                          "chunk's Newton-Schulz is not the matrix's); leave out "
                          "--shard_update, or use an element-wise optimizer (sgd, momentum, "
                          "adam)")


def check_warmup(options: OptimOptions, train_steps: int) -> None:
    """--warmup_steps at most the run's `train_steps` (--train_steps, checked before)."""
    if options.warmup_steps > train_steps:
        raise ConfigError(
            f"--warmup_steps={options.warmup_steps} is longer than --train_steps="
            f"{train_steps}; use at most {train_steps}")
