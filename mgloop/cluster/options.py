"""Where a run's towers are: the cluster part of the settings (`config.cluster`).

Data only, plain Python (no TensorFlow): `mgloop.runs.config` composes this part into
`Config` and the flags are made from its fields (settings.py); its check is checks.py's.
"""

from __future__ import annotations

import dataclasses

from mgloop.settings import setting

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
        "check for this many seconds (dead, stopped, hung) is declared lost within 10s more "
        "(one whose process ended, within seconds: its server refuses the checks), the "
        "collectives are aborted and the run fails (exit code 3 naming it), not hangs; >= 5",
        neutral=_WAITS)


MIN_PEER_TIMEOUT = 5.0  # seconds: the shortest --collective_timeout (see checks.py)
