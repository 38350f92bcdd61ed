"""How updates are made: the optimizer part of the settings (`config.optim`).

Plain Python (no TensorFlow): `mgloop.runs.config` composes this part into `Config`
and the flags are made from its fields (settings.py).
"""

from __future__ import annotations

import dataclasses

from mgloop.errors import ConfigError
from mgloop.settings import Context, choice, in_range, setting

OPTIMIZERS = ("sgd", "momentum", "adam")
LR_SCHEDULES = ("constant", "poly", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimOptions:
    """How updates are made: the optimizer part of the settings (`config.optim`)."""

    optimizer: str = setting("momentum", "one of: {choices} (momentum: SGD with --momentum)",
                             choices=OPTIMIZERS, hparam=True)
    learning_rate: float = setting(0.05, "peak learning rate", hparam=True)
    momentum: float = setting(0.9, "momentum of --optimizer=momentum", hparam=True)
    lr_schedule: str = setting("constant", "one of: {choices} (poly: Caffe's polynomial decay)",
                               choices=LR_SCHEDULES, hparam=True)
    lr_power: float = setting(1.0, "power of the poly schedule", hparam=True)
    warmup_steps: int = setting(0, "steps of linear warm-up before the schedule", hparam=True)
    weight_decay: float = setting(0.0, "decoupled weight decay (v -= lr * wd * v each update)",
                                  hparam=True)
    adam_epsilon: float = setting(1e-7, "epsilon of --optimizer=adam, added to sqrt(v) "
                                  "(Keras's default 1e-7)", hparam=True)


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
    return options


def check_warmup(options: OptimOptions, train_steps: int) -> None:
    """--warmup_steps at most the run's `train_steps` (--train_steps, checked before)."""
    if options.warmup_steps > train_steps:
        raise ConfigError(
            f"--warmup_steps={options.warmup_steps} is longer than --train_steps="
            f"{train_steps}; use at most {train_steps}")
