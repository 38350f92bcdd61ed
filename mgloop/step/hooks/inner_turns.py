"""The guard of `async_diloco` (aggregation/local/async_diloco.py): a node applies its inner update
only on the steps its own clock gives it, so a slower node takes fewer inner steps; and every
node's inner rate follows the run's clock, not its own count of updates.

Node n's copies run `update` inside `tf.cond(method.applies(n, s), update, nothing)` on the
step counter s (the clock's turn, and not waiting for a quorum): on the other steps its
parameters, optimizer slots and step count stay as they were (node failures' guard,
node_failures.py, with the clock for the schedule). Nodes at the fastest speed that never
wait (quorum 1, no grace window) are not guarded.

The rate. A Keras optimizer reads its schedule at its own update count, which the guard holds
back: a node 4x slower would end the run at a quarter of the schedule, its last rounds at
nearly the peak rate while the fast nodes' decay to 0. Liu et al. (2024, arXiv 2401.09135,
section 3: the learning-rate schedule by the progress of all workers; github:utnslab/halos
`get_batch_indexes`: a round starts at the tokens processed by every worker over the global
batch) set a worker's rate by the run's progress. Here every node's optimizer reads its
schedule at the step counter s instead (`OnTheClock`): the fastest node's steps, the unit of
the run's time, which with constant speeds is its progress in tokens, so every node warms up
and decays with the run (`put_on_the_clock`, done once as the guard is made). The node's
own count still drives Adam's bias correction of its own moments. At the fastest speed the
two are the same number: the fastest nodes' rates do not change, nor does any run at equal
speeds.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from mgloop.aggregation.local.async_diloco import AsyncDiLoCo
from mgloop.step.hooks.node_failures import FrozenWhileDown

Schedule = keras.optimizers.schedules.LearningRateSchedule


class OnTheClock(Schedule):
    """`schedule` read at the run's step counter `step`, whatever count it is called with."""

    def __init__(self, schedule: Schedule, step: tf.Variable):
        self.schedule, self.step = schedule, step

    def __call__(self, count):
        return self.schedule(tf.convert_to_tensor(self.step))


class _Turns:
    """The method's clock as node_failures' schedule: `fails` (guarded at all), `alive`."""

    def __init__(self, method: AsyncDiLoCo):
        self.method = method

    def fails(self, node: int) -> bool:
        clock = self.method.clock
        return clock.rates[node] < 1 or clock.quorum > 1 or clock.grace > 0  # may skip

    def alive(self, node: int, step):
        return self.method.applies(node, step)


def put_on_the_clock(copies, step: tf.Variable) -> None:
    """Each copy's optimizer reads its schedule at `step` (module docstring); a constant rate
    (a float or variable: Keras keeps it in `_learning_rate`, with no public reader of the
    schedule itself) has nothing to read and stays."""
    for copy in copies:
        schedule = copy.optimizer._learning_rate
        if isinstance(schedule, Schedule) and not isinstance(schedule, OnTheClock):
            copy.optimizer.learning_rate = OnTheClock(schedule, step)


def hook_for(replicas) -> FrozenWhileDown | None:
    """The guard for `replicas` whose method (or its inner method at the nodes) is
    async_diloco, with every copy's rate put on the clock; None otherwise."""
    level = replicas.aggregation
    method = getattr(level, "inner", level)  # a NodeLevel wraps the method of the nodes
    if not isinstance(method, AsyncDiLoCo) or method.num_towers == 1:
        return None
    put_on_the_clock(replicas.copies, replicas.global_step)
    per_copy = replicas.num_towers // len(replicas.copies)
    nodes = getattr(level, "nodes", None)
    return FrozenWhileDown(_Turns(method), replicas.global_step,
                           [nodes.node_of_tower(c * per_copy) if nodes is not None
                            else c * per_copy for c in range(len(replicas.copies))])
