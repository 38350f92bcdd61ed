"""How updates are made: the optimizer part of the settings (`config.optim`).

Data only, plain Python (no TensorFlow): `mgloop.runs.config` composes this part into
`Config` and the flags are made from its fields (settings.py); its checks are checks.py's.
"""

from __future__ import annotations

import dataclasses

from mgloop.settings import setting

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
