"""mgloop: a hand-written multi-device tower loop for research on gradient aggregation.

    import mgloop
    summary = mgloop.run(mgloop.Config(devices="cpu:4", aggregation="ring"))

See README.md for the tour and the flags; mgloop.devices to set up logical CPU
devices before TensorFlow starts.
"""

from mgloop.config import Config
from mgloop.errors import ConfigError
from mgloop.experiment import run

__all__ = ["Config", "ConfigError", "run"]
