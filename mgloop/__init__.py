"""mgloop: a hand-written multi-device tower loop for research on gradient aggregation.

    import mgloop
    summary = mgloop.run(mgloop.Config(devices="cpu:4", aggregation="ring"))

See README.md for the tour and the flags; mgloop.devices to set up logical CPU
devices before TensorFlow starts.

`Config`, `ConfigError` and `run` are loaded on first use, so that importing the
package loads no TensorFlow: `python -m mgloop.train` imports the package before
train.py runs, and train.py must act before TensorFlow loads (quiet_start.py).
"""

import importlib

_API = {"Config": "mgloop.config", "ConfigError": "mgloop.errors", "run": "mgloop.experiment"}

__all__ = ["Config", "ConfigError", "run"]


def __getattr__(name):
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'mgloop' has no attribute {name!r}")
