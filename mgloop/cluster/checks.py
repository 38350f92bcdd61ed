"""The cluster part's check (`config.cluster`, cluster/options.py), which the gate
(runs/config_checks.py) calls before any device or variable exists. A module of its own, so
that options.py holds data only (every part's check lives apart from its options).
"""

from __future__ import annotations

from mgloop.cluster.options import MIN_PEER_TIMEOUT, ClusterOptions
from mgloop.settings import in_range


def check(options: ClusterOptions, context) -> ClusterOptions:
    """Refuses towers per device and timeouts out of range, in one line each; returns the
    options unchanged. Needs nothing of `context`: it runs before --devices is parsed
    (cluster/devices.py `parse`, which needs K >= 1)."""
    in_range("towers_per_device", options.towers_per_device, low=1)
    in_range("startup_timeout", options.startup_timeout, low=0.0, low_open=True)
    # A peer is declared lost after this many seconds without an answer to the health checks,
    # made every max(0.5, timeout / 4) s (peer_health.py): under 5 s, four checks in a row of
    # a loaded but healthy peer could miss, so shorter timeouts are refused.
    in_range("collective_timeout", options.collective_timeout, low=MIN_PEER_TIMEOUT)
    return options
