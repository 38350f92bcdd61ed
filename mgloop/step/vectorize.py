"""`mgloop.step.vectorize`, the old name of step/pfor.py (vectorized_map and probe): its
names, kept until mgloop 0.2 with a DeprecationWarning."""

import warnings

from mgloop.step import pfor

warnings.warn("mgloop.step.vectorize is now mgloop.step.pfor; "
              "import it from there (the old name goes in mgloop 0.2)",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(pfor, name)
