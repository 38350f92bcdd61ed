"""The launcher's own settings (`python -m mgloop.launch`, mgloop/launch.py): `LaunchOptions`.

Data only, plain Python (no TensorFlow): the launcher's flags are made from these fields
(runs/flags.py `define_flags_of`, the rules `mgloop.train`'s flags follow) and read back
into one `LaunchOptions`; launch_checks.py refuses values out of range. The train flags
after `--` are not here: they reach every worker as given.
"""

from __future__ import annotations

import dataclasses

from mgloop.settings import entry_setting


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """How many local workers, on which devices, and how the launcher waits and restarts."""

    num_workers: int = entry_setting(2, "worker processes to start on this machine")
    devices_per_worker: str = entry_setting("cpu:2", "--devices of every worker")
    grace_seconds: float = entry_setting(
        60.0, "after a worker fails, how long the others get to stop by themselves "
        "(their collectives fail or their health checks give up) before they are terminated")
    stop_seconds: float = entry_setting(
        60.0, "after SIGTERM/SIGINT/SIGHUP (forwarded to every worker), how long the "
        "workers get to save and exit before they are killed")
    elastic: bool = entry_setting(
        False, "restart from failures: when a worker fails, continue with the others from "
        "the last complete checkpoint in --logdir, and take a replacement back later "
        "(mgloop/cluster/elastic.py)")
    min_workers: int = entry_setting(1, "--elastic: fewer live workers wait for a replacement")
    max_restarts: int = entry_setting(
        3, "--elastic: restarts after failures before the job stops (restarts that take a "
        "replacement back are not counted)")
    rejoin_seconds: float = entry_setting(
        60.0, "--elastic: a failed worker's replacement joins once the workers left have run "
        "this long and saved a newer checkpoint")
    netns: bool = entry_setting(
        False, "as root: run each worker in a network namespace of its own, its link shaped "
        "(tc tbf) to the --link=between:BANDWIDTH,LATENCY of the train flags; the namespaces "
        "are removed when the job ends (mgloop/cluster/netns.py)")


ELASTIC_ONLY = ("min_workers", "max_restarts", "rejoin_seconds")  # ignored without --elastic
