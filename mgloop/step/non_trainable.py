"""The towers' non-trainable state after a step (e.g. batch-norm moving statistics),
combined by mgloop's own exact path, never by the chosen aggregation method.

A compressing or stateful method (top-k, error feedback, a lower transport dtype)
is a choice about gradients; moving statistics sent through it would be
compressed too. So for each float variable v of copy 0, with T towers in this
process and W workers,

    s[v] = (((x_0 + x_1) + x_2) + ... + x_{T-1})     on the device of copy 0's v,
           x_t = tower t's value, sent there by `Aggregation.send` at its own dtype
    s[v] = sum over workers of s[v]                  (several workers: the exact packed
                                                      collective sum of cross_worker.py)
    m[v] = s[v] * 1/(W*T)

then sent (again with `send`, at its own dtype) to the device of every other
copy's v. Every copy takes the same m[v], whatever `--grad_reduce` says (a
mean of statistics, not a gradient). The sends count in the step's traffic;
the sum is in tower order, so it is the same on every run and every method.
Non-float state (seed generators' states, counters) is tower 0's: every tower
returns the same value (random_streams.py). A method that declares
`averages_non_trainable=False` (`independent`: replicas train alone) has copy
t keep tower t's own state.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from mgloop.aggregation import Aggregation
from mgloop.training.variables import VariableCopy


def _sum_in_tower_order(aggregation: Aggregation, values: Sequence[tf.Tensor],
                        sources: Sequence[str], home: str) -> tf.Tensor:
    """sum_t values[t] in tower order on `home` (each sent from sources[t]); not yet scaled."""
    total = None
    for value, source in zip(values, sources):
        received = aggregation.send(value, source, home, exact=True)
        with tf.device(home):
            total = received if total is None else total + received
    return total


def combine(aggregation: Aggregation, states: list[list[tf.Tensor]],
            copies: list[VariableCopy], tower_devices: Sequence[str]) -> list[list[tf.Tensor]]:
    """Per copy, the values its non-trainable variables take after the step (their sends
    counted as state in the traffic).

    `states[t]`: tower t's returned values (on its device), in the order of
    `copies[0].non_trainable`.
    """
    with aggregation.traffic.counting_state():
        return _combine(aggregation, states, copies, tower_devices)


def _combine(aggregation, states, copies, tower_devices):
    first = copies[0].non_trainable
    if not first:
        return [[] for _ in copies]
    if not aggregation.capabilities.averages_non_trainable:
        return [list(states[c]) for c in range(len(copies))]
    floats = [i for i, v in enumerate(first) if v.dtype.is_floating]
    sums = [_sum_in_tower_order(aggregation, [state[i] for state in states], tower_devices,
                                first[i].device) for i in floats]
    if aggregation.cluster is not None:  # across workers (cross_worker.py)
        sums = aggregation.all_workers_sum_packed(sums)
    means = {}
    for i, total in zip(floats, sums):
        with tf.device(first[i].device):
            means[i] = total * tf.cast(1.0 / aggregation.num_towers, total.dtype)
    per_copy = []
    for copy in copies:
        values = list(states[0])
        for i, mean in means.items():
            home = copy.non_trainable[i].device
            values[i] = aggregation.send(mean, first[i].device, home, exact=True)
        per_copy.append(values)
    return per_copy
