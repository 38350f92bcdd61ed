"""`mgloop.step.tower_step`, the old name of step/training_step.py (TowerStep, the
training step): its names, kept until mgloop 0.2 with a DeprecationWarning."""

import warnings

from mgloop.step import training_step

warnings.warn("mgloop.step.tower_step is now mgloop.step.training_step; "
              "import it from there (the old name goes in mgloop 0.2)",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(training_step, name)
