"""How each tower computes its step: the step part of the settings (`config.step`):
vectorized or compiled towers, memory-saving sums, faults injected, accumulation,
precision and batch norm.

Data only, plain Python (no TensorFlow): `mgloop.runs.config` composes this part into
`Config` and the flags are made from its fields (settings.py); its check is checks.py's.
"""

from __future__ import annotations

import dataclasses

from mgloop.settings import setting

ORDERED_SUM_MIN_BYTES = 16 * 2 ** 20  # the default of --ordered_sum_bytes
SUFFICIENT_FACTOR_MIN_BYTES = 16 * 2 ** 20  # the default of --sufficient_factor_bytes
BYZANTINE_CHOICES = ("fixed", "random")
POLICIES = ("none", "mixed_float16", "mixed_bfloat16")
BATCH_NORM_MODES = ("per_tower", "sync")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How each tower computes its step (`config.step`)."""

    xla_towers: bool = setting(
        False, "compile each tower's forward, loss and backward with XLA (one "
        "tf.function(jit_compile=True), traced once, compiled per device: "
        "step/compiled_towers.py): fewer, fused kernels per tower; the exchange and the "
        "update stay uncompiled",
        hparam=True)
    ordered_sum_bytes: int = setting(
        ORDERED_SUM_MIN_BYTES, "shared layout (ps_*) on logical CPU towers: the "
        "gradients of each variable of at least this many bytes are summed tower by tower, "
        "tower t's backward pass starting once tower t-1's were added, so two copies of them "
        "are alive instead of T + 1 (the towers' backward passes no longer overlap); 0: off",
        hparam=True)
    sufficient_factor_bytes: int = setting(
        SUFFICIENT_FACTOR_MIN_BYTES, "shared layout (ps_*) on logical CPU towers: a "
        "variable of at least this many bytes used by one plain matmul z = x W per tower (a "
        "float32 Dense kernel) gets its summed gradient as one product X^T dZ of the towers' "
        "inputs and output gradients at its home, instead of one full-size gradient per "
        "tower; 0: off", hparam=True)
    byzantine_towers: int = setting(
        0, "k: towers whose gradients --attack alters before the exchange, for robustness "
        "studies (0: none; 1 <= k < towers)", hparam=True)
    attack: str = setting(
        "signflip", "what a --byzantine_towers tower sends instead of its gradient g: "
        "signflip[:factor=F] (-F g), scaled:factor=F (F g), gaussian:std=S (N(0, S^2) "
        "noise instead of g), zero, labelflip (trains on labels C-1-y), alie[:z=Z] (honest "
        "mean - Z sd, Baruch et al. 2019), ipm[:epsilon=E] (-E honest mean, Xie et al. 2020)",
        hparam=True)
    byzantine_choice: str = setting(
        "fixed", "which towers: fixed (towers 0..k-1 every step) | random (k drawn each "
        "step, seeded by --seed)", choices=BYZANTINE_CHOICES, hparam=True)
    accumulation_steps: int = setting(
        1, "micro-batches per update: each tower sums its gradients over K consecutive global "
        "batches before one exchange and one update (effective batch K x global batch; "
        "--train_steps counts updates)", hparam=True)
    mixed_precision: str = setting(
        "none", "none | mixed_float16 | mixed_bfloat16: Keras dtype policy of the model "
        "(float32 variables, 16-bit compute); mixed_float16 adds dynamic loss scaling, an "
        "overflow on any tower skipping the update on all", choices=POLICIES,
        hparam=True)
    batch_norm: str = setting(
        "per_tower", "per_tower (each tower's shard statistics, moving statistics averaged "
        "over towers) | sync (batch statistics over the global batch across towers)",
        choices=BATCH_NORM_MODES, hparam=True)

