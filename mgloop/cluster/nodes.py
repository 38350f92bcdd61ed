"""`mgloop.cluster.nodes`, the old name of cluster/node_layout.py (Nodes, the nodes'
topology): its names, kept until mgloop 0.2 with a DeprecationWarning."""

from mgloop import lazy_package

__getattr__ = lazy_package.moved_to(__name__, "mgloop.cluster.node_layout")
