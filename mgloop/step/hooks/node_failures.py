"""The guard of node failures: a down node's copies take no update.

With `--node_failures` (aggregation/placement/node_failures.py) the copies of node n apply the
step's update only while n is live, `tf.cond(alive(n, s), update, nothing)` on the step
counter s inside the compiled step: a down node's parameters, optimizer slots and step
count (and its non-trainable state) stay as they were until it returns and takes a live
node's. A shared layout (ps_*) has one copy, the live nodes' mean: it always applies.
"""

from __future__ import annotations

import tensorflow as tf

from mgloop.step.hooks import Hook


class FrozenWhileDown(Hook):
    """`schedule` (node_failures.Schedule) read at `step`; `node_of_copy[c]`: copy c's node
    (None: a copy of every node, always updated)."""

    def __init__(self, schedule, step: tf.Variable, node_of_copy: list[int | None]):
        self.schedule, self.step, self.node_of_copy = schedule, step, list(node_of_copy)

    def may_apply(self, grads):
        def guard(copy: int, update) -> None:
            node = self.node_of_copy[copy]
            if node is None or not self.schedule.fails(node):
                update()
                return

            def apply():
                update()
                return tf.constant(True)
            tf.cond(self.schedule.alive(node, self.step), apply, lambda: tf.constant(False))
        return guard


def hook_for(schedule, replicas) -> FrozenWhileDown | None:
    """The guard for `replicas` (their aggregation a NodeLevel), or None without failures."""
    if schedule is None:
        return None
    level = replicas.aggregation
    if len(replicas.copies) == 1:
        return FrozenWhileDown(schedule, replicas.global_step, [None])
    per_copy = replicas.num_towers // len(replicas.copies)
    return FrozenWhileDown(schedule, replicas.global_step,
                           [level.nodes.node_of_tower(c * per_copy)
                            for c in range(len(replicas.copies))])
