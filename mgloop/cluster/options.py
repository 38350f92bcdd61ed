"""Where a run's towers are: the cluster part of the settings (`config.cluster`).

Plain Python (no TensorFlow): `mgloop.runs.config` composes this part into `Config`
and the flags are made from its fields (settings.py).
"""

from __future__ import annotations

import dataclasses

from mgloop.settings import in_range, setting

_WAITS = "only how long to wait for peers"


@dataclasses.dataclass(frozen=True)
class ClusterOptions:
    """Where a run's towers are: the cluster part of the settings (`config.cluster`)."""

    devices: str = setting(
        "auto", "auto | cpu:N | gpu | gpu:I,J,... (auto: all GPUs, else 2 simulated CPU towers)",
        hparam=True)
    towers_per_device: int = setting(
        1, "K: towers on each device, computed together as one vectorized pass "
        "(tf.vectorized_map: each tower its own shard, random stream and batch-norm "
        "statistics) and reading one variable copy per device; towers = devices x K",
        hparam=True)
    startup_timeout: float = setting(
        60.0, "several processes (TF_CONFIG): seconds to wait for every peer at start",
        neutral=_WAITS)
    collective_timeout: float = setting(
        30.0, "several processes: the peer health timeout: a peer that answers no health "
        "check for this many seconds (dead, stopped, hung) is declared lost within 10s more, "
        "the collectives are aborted and the run fails (exit code 3 naming it), not hangs; "
        ">= 5", neutral=_WAITS)


MIN_PEER_TIMEOUT = 5.0  # seconds: the shortest --collective_timeout (see `check`)


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
