"""`mgloop.step.towers`, the old name of step/per_tower.py (TowerOutput and the per-tower
pass): its names, kept until mgloop 0.2 with a DeprecationWarning."""

from mgloop import lazy_package

__getattr__ = lazy_package.moved_to(__name__, "mgloop.step.per_tower")
