"""`mgloop.step.vectorize`, the old name of step/pfor.py (vectorized_map and probe): its
names, kept until mgloop 0.2 with a DeprecationWarning."""

from mgloop import lazy_package

__getattr__ = lazy_package.moved_to(__name__, "mgloop.step.pfor")
