"""`mgloop.cluster.nodes`, the old name of cluster/node_layout.py (Nodes, the nodes'
topology): its names, kept until mgloop 0.2 with a DeprecationWarning."""

import warnings

from mgloop.cluster import node_layout

warnings.warn("mgloop.cluster.nodes is now mgloop.cluster.node_layout; "
              "import it from there (the old name goes in mgloop 0.2)",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(node_layout, name)
