"""How updates are made: the optimizer part of the settings (`config.optim`).

Plain Python (no TensorFlow): `mgloop.runs.config` composes this part into `Config`
and the flags are made from its fields (settings.py).
"""

from __future__ import annotations

import dataclasses

from mgloop.errors import ConfigError
from mgloop.settings import Context, choice, in_range, setting

OPTIMIZERS = ("sgd", "momentum", "adam", "muon")
MUON_DEFAULTS = {"muon_adam_lr_ratio": 1.0, "muon_rms_rate": 0.2}  # Keras's Muon's own
LR_SCHEDULES = ("constant", "poly", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimOptions:
    """How updates are made: the optimizer part of the settings (`config.optim`)."""

    optimizer: str = setting(
        "momentum", "one of: {choices} (momentum: SGD with --momentum; muon: Keras's Muon "
        "on the hidden matrices, its AdamW part on the rest, the output layer included: "
        "docs/training.md#muon)", choices=OPTIMIZERS, hparam=True)
    learning_rate: float = setting(0.05, "peak learning rate", hparam=True)
    momentum: float = setting(0.9, "momentum of --optimizer=momentum, and of muon's matrices "
                              "(Keras's Muon's own default: 0.95)", hparam=True)
    lr_schedule: str = setting("constant", "one of: {choices} (poly: Caffe's polynomial decay)",
                               choices=LR_SCHEDULES, hparam=True)
    lr_power: float = setting(1.0, "power of the poly schedule", hparam=True)
    warmup_steps: int = setting(0, "steps of linear warm-up before the schedule", hparam=True)
    weight_decay: float = setting(0.0, "decoupled weight decay (v -= lr * wd * v each update)",
                                  hparam=True)
    adam_epsilon: float = setting(1e-7, "epsilon of --optimizer=adam and of muon's AdamW part, "
                                  "added to sqrt(v) (Keras's default 1e-7)", hparam=True)
    muon_adam_lr_ratio: float = setting(
        1.0, "--optimizer=muon: its AdamW part's rate over --learning_rate (Keras's "
        "adam_lr_ratio)", hparam=True)
    muon_rms_rate: float = setting(
        0.2, "--optimizer=muon: a matrix's orthogonalised step times rms_rate * "
        "sqrt(max(rows, cols)) (Moonlight's scale; Keras's default 0.2); 0: unscaled",
        hparam=True)


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
