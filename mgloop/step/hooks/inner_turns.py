"""The guard of `async_diloco` (aggregation/local/async_diloco.py): a node applies its inner update
only on the steps its own clock gives it, so a slower node takes fewer inner steps.

Node n's copies run `update` inside `tf.cond(method.applies(n, s), update, nothing)` on the
step counter s (the clock's turn, and not waiting for a quorum): on the other steps its
parameters, optimizer slots and step count stay as they were (node failures' guard,
node_failures.py, with the clock for the schedule). Nodes at the fastest speed that never
wait (quorum 1, no grace window) are not guarded.
"""

from __future__ import annotations

from mgloop.aggregation.local.async_diloco import AsyncDiLoCo
from mgloop.step.hooks.node_failures import FrozenWhileDown


class _Turns:
    """The method's clock as node_failures' schedule: `fails` (guarded at all), `alive`."""

    def __init__(self, method: AsyncDiLoCo):
        self.method = method

    def fails(self, node: int) -> bool:
        clock = self.method.clock
        return clock.rates[node] < 1 or clock.quorum > 1 or clock.grace > 0  # may skip

    def alive(self, node: int, step):
        return self.method.applies(node, step)


def hook_for(replicas) -> FrozenWhileDown | None:
    """The guard for `replicas` whose method (or its inner method at the nodes) is
    async_diloco; None otherwise."""
    level = replicas.aggregation
    method = getattr(level, "inner", level)  # a NodeLevel wraps the method of the nodes
    if not isinstance(method, AsyncDiLoCo) or method.num_towers == 1:
        return None
    per_copy = replicas.num_towers // len(replicas.copies)
    nodes = getattr(level, "nodes", None)
    return FrozenWhileDown(_Turns(method), replicas.global_step,
                           [nodes.node_of_tower(c * per_copy) if nodes is not None
                            else c * per_copy for c in range(len(replicas.copies))])
