"""The exchange over the live nodes only, when simulated nodes fail (node_failures.py).

A node failure schedule has few distinct sets of live nodes L (at most one more than
twice its outages). The step holds one branch per set, `tf.switch_case` on the index of
L_s read from the step counter (one traced graph for every step), and each branch runs
the exchange among the nodes of L only, as torchft re-forms its process group over the
quorum's replicas: a down node sends and receives nothing, and every branch records
its sends on its own occasion (traffic.py, "nodes 0,1,3 live"), so the bytes of step s
are those of L_s's exchange, exactly what travels.

    exact_reduce   NodeLevel's three stages on the live nodes: their node means (stage 1),
                   the method made on the live leaders (`make_live_methods`: it averages
                   over |L| itself), their results to their towers (stage 3); a down
                   node's copies get zeros, which they do not apply (the step's guard)
    ring_mean      local_steps.py's ring of parameters (or warmup gradients) among the
                   live copies: (1/|L|) sum_{c in L} v_c on every live copy; a down copy
                   gets its own value back, which it does not take

Sparse gradients (IndexedSlices) are made dense here, so that every branch returns the
same structure.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from mgloop.aggregation.base import REPLICATED
from mgloop.aggregation.dense.ring import sharded_ring_all_reduce


def make_live_methods(schedule, make_method, spec: str, transport_dtype: str, leaders,
                      devices, traffic) -> dict:
    """{live set: the method `spec` made on its leaders (`make_method(spec, DeviceSet,
    dtype, traffic=...)`, counting into `traffic`)} for every live set of `schedule` but
    all nodes (there: the method itself)."""
    return {live: make_method(spec, dataclasses.replace(devices, towers=tuple(leaders[n]
                                                                            for n in live)),
                              transport_dtype, traffic=traffic)
            for live in schedule.sets() if len(live) < schedule.nodes}


def _switch(schedule, step, branch):
    sets = schedule.sets()
    if len(sets) == 1:
        return branch(0)()
    return tf.switch_case(schedule.set_index(step), [branch(k) for k in range(len(sets))])


def exact_reduce(level, tower_values, variables):
    """Every copy's gradient: the live nodes' mean on a live node's copies, zeros on a down
    node's (NodeLevel, `level.failures` the schedule)."""
    schedule, towers = level.failures, level.devices.towers

    def branch(k):
        live = schedule.sets()[k]

        def run():
            with level.traffic.on(schedule.occasion(k)):
                means = level.node_means(tower_values, variables, live)
                method = level.live_methods.get(live, level.inner)
                out = [[tf.convert_to_tensor(v) for v in values]
                       for values in method.reduce(means, variables, True)]
                if level.capabilities.layout != REPLICATED:
                    return out
                by_node = [None] * level.nodes.count
                for n, values in zip(live, out):
                    by_node[n] = values
                result = []
                for t in level._device_firsts():
                    if level.nodes.node_of_tower(t) in live:
                        result.append([tf.convert_to_tensor(v)
                                       for v in level._from_leader(by_node, t)])
                        continue
                    with tf.device(towers[t]):  # (shaped as what is exchanged: maybe buckets)
                        result.append([tf.zeros_like(tf.convert_to_tensor(v))
                                       for v in tower_values[t]])
                return result
        return run
    return _switch(schedule, level.step_counter, branch)


def ring_mean(method, flats: list[tf.Tensor], devices: list[str], average: bool) -> list:
    """The ring among the live copies (copy c is node c: `method.live` the schedule)."""
    schedule, outer = method.live, method.traffic.occasion

    def branch(k):
        live = schedule.sets()[k]

        def run():
            with method.traffic.on(schedule.occasion(k, outer)):
                sums = sharded_ring_all_reduce(method, [flats[c] for c in live],
                                               [devices[c] for c in live], 1, False)
            out = list(flats)
            for c, total in zip(live, sums):  # the method's own scale is 1/N: here 1/|L|
                with tf.device(devices[c]):
                    out[c] = total * (1.0 / len(live)) if average else total
            return out
        return run
    return _switch(schedule, method.step_counter, branch)
