"""The exchange part's check (`config.exchange`, exchange_options.py), which the gate
(runs/config_checks.py) calls first, before any device or variable exists.

A module of its own, so that exchange_options.py stays data only: the checks it calls
(validation.py: the method and the nodes; shard_settings.py) import exchange_options.py,
never the other way round. Importing it loads the methods (and TensorFlow).
"""

from __future__ import annotations

import dataclasses

from mgloop.aggregation import plugins, shard_settings, validation
from mgloop.aggregation.exchange_options import ExchangeOptions


def check(options: ExchangeOptions, context) -> ExchangeOptions:
    """Refuses, in one line each, the exchange settings that do not combine on the run of
    `context` (settings.Context: its towers, workers, --deterministic): the method and its
    options (validation.py), the nodes (node_settings.py). Returns the options with
    `plugins` a tuple of module names (a lone string is one module)."""
    validation.check_method(options, context)
    shard_settings.check(options, context)
    return dataclasses.replace(options, plugins=plugins.plugin_list(options.plugins))
