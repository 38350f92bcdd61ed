"""The launcher's check of its own settings (launch_options.py), made before any worker
process, namespace or folder exists. A module of its own, so that launch_options.py holds
data only (as every part's check lives apart from its options). The settings that need the
train flags after `--` (--devices there, --netns's link, --elastic's --logdir and batch)
are checked in mgloop/launch.py, netns.py and elastic.py.
"""

from __future__ import annotations

import math

from mgloop.cluster.launch_options import ELASTIC_ONLY, LaunchOptions
from mgloop.errors import ConfigError
from mgloop.settings import in_range


def check(options: LaunchOptions, given: tuple[str, ...] = ()) -> LaunchOptions:
    """Refuses, in one line naming the flag and what is valid: a setting of --elastic given
    without it (it would be ignored; `given`: the launcher flags set on the command line),
    --num_workers < 1, negative or NaN seconds. Returns the options unchanged."""
    if not options.elastic:
        for name in ELASTIC_ONLY:
            if name in given:
                raise ConfigError(
                    f"--{name} applies only to an elastic job: add --elastic (a failed worker "
                    f"then does not end the job), or drop --{name}")
    in_range("num_workers", options.num_workers, low=1)
    for flag, value in (("grace_seconds", options.grace_seconds),
                        ("stop_seconds", options.stop_seconds)):
        if math.isnan(value):  # it passes every comparison
            raise ConfigError(f"--{flag}={value} is not a number: must be >= 0 seconds")
        in_range(flag, value, low=0)
    return options
