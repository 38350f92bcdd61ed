"""Which model a run trains: the models part of the settings (`config.models`).

Data only, plain Python (no TensorFlow): `mgloop.runs.config` composes this part into
`Config` and the flags are made from its fields (settings.py); its check is checks.py's.
"""

from __future__ import annotations

import dataclasses

from mgloop.settings import setting


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """Which model a run trains: the models part of the settings (`config.models`)."""

    model: str = setting("mlp", "one of: {choices}", hparam=True)  # flags.py: the registry's
    mlp_width: int | None = setting(
        None, "--model=mlp: units of each hidden layer (default 128)", hparam=True)
    mlp_depth: int | None = setting(
        None, "--model=mlp: hidden layers (default 2)", hparam=True)
    lm_layers: int | None = setting(
        None, "--model=transformer_lm: decoder blocks (default 2)", hparam=True)
    lm_width: int | None = setting(
        None, "--model=transformer_lm: model width, a multiple of --lm_heads (default 64)",
        hparam=True)
    lm_heads: int | None = setting(
        None, "--model=transformer_lm: attention heads (default 4)", hparam=True)

