"""`mgloop.aggregation.nodes`, the old name of placement/between_nodes.py (NodeLevel and
make, the method between nodes): its names, kept until mgloop 0.2 with a
DeprecationWarning."""

from mgloop import lazy_package

__getattr__ = lazy_package.moved_to(__name__, "mgloop.aggregation.placement.between_nodes")
