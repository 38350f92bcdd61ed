"""`mgloop.step.tower_step`, the old name of step/training_step.py (TowerStep, the
training step): its names, kept until mgloop 0.2 with a DeprecationWarning."""

from mgloop import lazy_package

__getattr__ = lazy_package.moved_to(__name__, "mgloop.step.training_step")
