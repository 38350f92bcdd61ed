"""`mgloop.step.towers`, the old name of step/per_tower.py (TowerOutput and the per-tower
pass): its names, kept until mgloop 0.2 with a DeprecationWarning."""

import warnings

from mgloop.step import per_tower

warnings.warn("mgloop.step.towers is now mgloop.step.per_tower; "
              "import it from there (the old name goes in mgloop 0.2)",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(per_tower, name)
