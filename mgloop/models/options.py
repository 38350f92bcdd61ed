"""Which model a run trains: the models part of the settings (`config.models`).

Plain Python (no TensorFlow): `mgloop.runs.config` composes this part into `Config`
and the flags are made from its fields (settings.py). `check` loads the model registry
(and Keras with it) when it is called.
"""

from __future__ import annotations

import dataclasses

from mgloop.settings import Context, setting


def _model_names():
    from mgloop import models
    return models.names()


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """Which model a run trains: the models part of the settings (`config.models`)."""

    model: str = setting("mlp", "one of: {choices}", choices=_model_names, hparam=True)
    lm_layers: int | None = setting(
        None, "--model=transformer_lm: decoder blocks (default 2)", hparam=True)
    lm_width: int | None = setting(
        None, "--model=transformer_lm: model width, a multiple of --lm_heads (default 64)",
        hparam=True)
    lm_heads: int | None = setting(
        None, "--model=transformer_lm: attention heads (default 4)", hparam=True)


def check(options: ModelOptions, context: Context) -> ModelOptions:
    """Refuses an unknown --model, another model's settings, and a bad combination of the
    model's own (registry.py); returns the options with the model's own settings resolved
    to its builder's defaults where unset (the values a run records)."""
    from mgloop.models import registry  # noqa: PLC0415 -- it loads Keras
    registry.check_model_sizes(options)
    return dataclasses.replace(options, **registry.resolved_settings(options))
