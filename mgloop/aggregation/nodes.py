"""`mgloop.aggregation.nodes`, the old name of aggregation/between_nodes.py (NodeLevel and
make, the method between nodes): its names, kept until mgloop 0.2 with a
DeprecationWarning."""

import warnings

from mgloop.aggregation import between_nodes

warnings.warn("mgloop.aggregation.nodes is now mgloop.aggregation.between_nodes; "
              "import it from there (the old name goes in mgloop 0.2)",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(between_nodes, name)
