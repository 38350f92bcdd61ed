"""How updates are made: the optimizer part of the settings (`config.optim`).

Plain Python (no TensorFlow): `mgloop.runs.config` composes this part into `Config`
and the flags are made from its fields (settings.py).
"""

from __future__ import annotations

import dataclasses

from mgloop.settings import setting

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
