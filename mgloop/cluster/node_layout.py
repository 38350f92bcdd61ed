"""Nodes: N machines' worth of towers, simulated in one process or one per worker.

A run's T towers are split into N nodes of T/N contiguous towers each, node-major (node n
holds towers n T/N .. (n+1) T/N - 1, as workers hold theirs); a node's first tower is its
leader, and the host CPU counts as node 0's. What runs between and within the nodes is
placement/between_nodes.py; the bytes between them are counted by tier (aggregation/traffic.py)
through `device_map`.
"""

from __future__ import annotations

import dataclasses

from mgloop.cluster.devices import canonical


@dataclasses.dataclass(frozen=True)
class Nodes:
    """N nodes over `towers` (contiguous, node-major) and the host (node 0's)."""

    towers: tuple[str, ...]
    count: int
    host: str

    @property
    def per_node(self) -> int:
        return len(self.towers) // self.count

    def members(self, node: int) -> list[int]:
        return list(range(node * self.per_node, (node + 1) * self.per_node))

    def leader(self, node: int) -> int:
        return node * self.per_node

    def node_of_tower(self, tower: int) -> int:
        return tower // self.per_node

    def device_map(self) -> dict[str, int]:
        """canonical device -> node, for the traffic's tiers."""
        out = {canonical(self.host): 0}
        out.update({canonical(d): self.node_of_tower(t) for t, d in enumerate(self.towers)})
        return out
