"""Across workers: the local method inside each worker, then a collective between workers.

With W workers of T towers each (W*T towers in all, tower order worker-major),

    1. inside worker w, the chosen local method sums its towers' gradients:
           s_w[v] = sum_{t in w} g[t][v]          (on the worker's copy 0 device)
    2. the W sums meet in TensorFlow's collective all-reduce over gRPC:
           s[v] = sum_w s_w[v]                   (on every worker's copy 0 device)
    3. each worker scales by 1/(W*T) and sends the result to its other copies.

So g = (1/(W*T)) sum over all towers, the same mean as one process with W*T
towers. Every collective has a timeout, so a worker whose peer died raises
DeadlineExceeded instead of waiting forever. Group and instance keys come from
counters that every worker advances in the same order, because every worker
builds and traces the same functions in the same order.
"""

from __future__ import annotations

import itertools

import tensorflow as tf

from mgloop.aggregation.base import Aggregation, canonical
from mgloop.cluster import Cluster

_GROUP_KEYS = itertools.count(1_000_000)
_INSTANCE_KEYS = itertools.count(1_000_000)


class CrossWorker(Aggregation):
    """Wraps one worker's local aggregation with a collective between the workers."""

    def __init__(self, local: Aggregation, cluster: Cluster, timeout: float):
        super().__init__(local.devices, local.options)
        self.local = local
        self.cluster = cluster
        self.timeout = timeout
        self.traffic = local.traffic  # one set of counts for both stages
        self.name, self.layout = local.name, local.layout
        self.exchanges, self.single_loss = local.exchanges, local.single_loss
        self.group_key = next(_GROUP_KEYS)
        self.device = local.parameter_devices()[0]
        with tf.device(self.device):
            self.ordering_token = tf.Variable(0.0, trainable=False, name="cross_worker_token")

    @property
    def num_towers(self) -> int:
        return self.local.num_towers * self.cluster.num_workers

    def parameter_devices(self):
        return self.local.parameter_devices()

    def variable_scope(self):
        return self.local.variable_scope()

    def all_workers_sum(self, value: tf.Tensor) -> tf.Tensor:
        """sum over workers of `value` (on this worker's copy 0 device)."""
        if self.cluster.num_workers == 1:
            return value
        with tf.device(self.device):
            return tf.raw_ops.CollectiveReduceV2(
                input=value, group_size=self.cluster.num_workers, group_key=self.group_key,
                instance_key=next(_INSTANCE_KEYS), ordering_token=[self.ordering_token.handle],
                merge_op="Add", final_op="Id", communication_hint="auto",
                timeout_seconds=self.timeout)

    def reduce(self, tower_values, variables, average=True):
        local_sums = self.local.reduce(tower_values, variables, average=False)
        workers = self.cluster.num_workers
        totals = []
        for value in local_sums[0]:
            num_bytes = value.shape.num_elements() * value.dtype.size * 2 * (workers - 1) // workers
            self.traffic.add(canonical(self.device), sent=num_bytes, received=num_bytes)
            total = self.all_workers_sum(value)
            with tf.device(self.device):
                totals.append(self.scale(total, average))
        out = [totals]
        for copy_device in self.parameter_devices()[1:]:
            out.append([self.send(t, self.device, copy_device) for t in totals])
        return out

    def broadcast_from_chief(self, variables: list[tf.Variable]) -> None:
        """Makes `variables` equal to worker 0's: a sum to which only the chief contributes."""
        chief = tf.constant(1.0 if self.cluster.is_chief else 0.0)
        for variable in variables:
            with tf.device(variable.device):
                value = variable.read_value()
                mine = value * tf.cast(chief, value.dtype)
            variable.assign(self.all_workers_sum(mine))
