"""What runs/ asks a method about where it runs, instead of probing its type.

`Aggregation` inherits these answers for a method on the towers of one process; the
wrappers that place a method elsewhere answer for it: NodeLevel (between_nodes.py: the
method between nodes, whole nodes of towers, some of them possibly down) and CrossWorker
(cross_worker.py: each worker a node, its local stage the method at that node).
"""

from __future__ import annotations


class PlacementQueries:
    """Answers for a method on the towers of one process (a wrapper overrides them)."""

    @property
    def exchanges_between_workers(self) -> bool:
        """The method itself moves values between the worker processes (peers.py), so a
        cross-worker stage around it adds only the step's metrics: False on towers."""
        return False

    def towers_per_node(self) -> int:
        """Towers that make one node (an attacker is a whole node): 1 outside nodes."""
        return 1

    def failure_schedule(self):
        """The nodes' failure schedule (node_failures.NodeFailures), or None: no node ever
        goes down (the method is not between nodes, or no failures were asked for)."""
        return None

    def node_state_variables(self) -> list | None:
        """The method state only this worker's node holds, or None when the method is not
        between workers at the nodes (node_checkpoint.py: each node saves its own)."""
        return None
