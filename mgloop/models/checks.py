"""The models part's check (`config.models`, models/options.py), which the gate
(runs/config_checks.py) calls before any device or variable exists.

A module of its own, so that options.py stays data only: it checks the settings against
the registered builders (registry.py, which loads Keras and the built-in models).
"""

from __future__ import annotations

import dataclasses

from mgloop.models import registry
from mgloop.models.options import ModelOptions
from mgloop.settings import Context


def check(options: ModelOptions, context: Context) -> ModelOptions:
    """Refuses an unknown --model, another model's settings, and a bad combination of the
    model's own (builders.py); returns the options with the model's own settings resolved
    to its builder's defaults where unset (the values a run records)."""
    registry.check_model_sizes(options)
    return dataclasses.replace(options, **registry.resolved_settings(options))
