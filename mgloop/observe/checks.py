"""The observe part's check (`config.observe`, observe/options.py), which the gate
(runs/config_checks.py) calls before any device or variable exists.

A module of its own, so that options.py stays data only: the checks it calls live beside
what they refuse (link_model.py, hardware.py), never imported by options.py.
"""

from __future__ import annotations

from mgloop.observe import hardware, link_model
from mgloop.observe.options import ObserveOptions
from mgloop.settings import Context, in_range


def check(options: ObserveOptions, context: Context) -> ObserveOptions:
    """The intervals are >= 0 (0: none, or only at the end), every --link parses into one
    model (link_model.check_links) and --compute names a way to set the compute
    (hardware.parse); returns `options` unchanged. Checked beside it, as combinations:
    --node_speeds against the node count (hardware.parse_speeds), --profile_steps against
    --train_steps (runs/monitor.parse_profile_steps)."""
    for name in ("summary_every", "log_every", "eval_every", "histogram_every",
                 "breakdown_every"):
        in_range(name, getattr(options, name), low=0)
    link_model.check_links(options.links)
    hardware.parse(options.compute)
    return options
