"""Across workers: the local method inside each worker, then a collective between workers.

With W workers of T towers each (W*T towers in all, tower order worker-major),

    1. inside worker w, the chosen local method sums its towers' gradients:
           s_w[v] = sum_{t in w} g[t][v]          (on the worker's copy 0 device)
    2. the W sums meet in TensorFlow's collective all-reduce over gRPC:
           s[v] = sum_w s_w[v]                   (on every worker's copy 0 device)
    3. each worker scales by 1/(W*T) and sends the result to its other copies.

So g = (1/(W*T)) sum over all towers, the same mean as one process with W*T
towers. Step 2 is one collective per dtype, whatever `--pack_bytes` is (that
setting packs the local stage): the local sums are flattened and concatenated
into one buffer on the copy 0 device (packing.plan_by_dtype), summed, and split
back into their shapes, because over gRPC a collective's fixed round trip costs
far more than its bytes. The step's metrics (its mean loss and accuracy counts,
`reduce_with_metrics`) ride in the same buffer, so a float32 model's training
step makes ONE collective between workers. Each worker sends and receives
2(W-1)/W of the buffer's bytes in 2(W-1) messages each way (a ring all-reduce), as
counted in `traffic` on the worker's copy 0 device.
The collectives carry no timeout (each timeout would park a runtime thread for
its length, thousands of threads at hundreds of steps a second): a dead, stopped
or hung peer is found by mgloop/cluster/peer_health.py, which aborts the collectives so
that the waiting one raises UnavailableError naming the peer. Group and instance keys come from
counters that every worker advances in the same order, because every worker
builds and traces the same functions in the same order.
"""

from __future__ import annotations

import tensorflow as tf

from mgloop.aggregation.base import Aggregation, canonical
from mgloop.aggregation.kernels import packing
from mgloop.aggregation.placement.collective_keys import (new_worker_group_key,
                                                          new_worker_instance_key)
from mgloop.aggregation.placement.shard_exchange import ShardsUpdate
from mgloop.cluster.workers import Cluster



class CrossWorker(Aggregation):
    """Wraps one worker's local aggregation with a collective between the workers. The local
    stage is made knowing the workers it is one of (its `cluster`: nodes.make)."""

    def __init__(self, local: Aggregation, cluster: Cluster):
        if local.cluster is not cluster:
            raise ValueError("the local stage of the workers' exchange is made with their "
                             "cluster (aggregation/placement/between_nodes.py make(..., workers))")
        super().__init__(local.devices, local.options, local.transport_dtype.name,
                         cluster=cluster, traffic=local.traffic,  # one set of counts for both
                         step_counter=local.step_counter)  # and one step, the local stage's
        self.local = local
        self.name, self.options_type = local.name, local.options_type
        self.capabilities = local.capabilities  # the local method's, as declared
        self.group_key = new_worker_group_key()
        self.device = local.parameter_devices()[0]
        with tf.device(self.device):
            self.ordering_token = tf.Variable(0.0, trainable=False, name="cross_worker_token")

    def towers_per_node(self) -> int:
        """Each worker is a node of its local stage's towers (between nodes), else 1."""
        return self.local.towers_per_node()

    def node_state_variables(self) -> list | None:
        """The local stage's state where the method itself moves values between the
        workers at the nodes (each worker's node holds its own); else None."""
        if not self.local.exchanges_between_workers:
            return None
        return list(self.local.state_variables)

    @property
    def num_towers(self) -> int:
        return self.local.num_towers * self.cluster.num_workers

    def parameter_devices(self):
        return self.local.parameter_devices()

    def variable_scope(self):
        return self.local.variable_scope()

    def check_model(self, variables):
        self.local.check_model(variables)

    def build(self, variables):
        self.local.build(variables)

    def tower_values(self, tower, values):
        return self.local.tower_values(tower, values)

    def syncs(self):
        return self.local.syncs()

    def after_update(self, copies):
        """The local method's (this worker's copies only: the methods that average
        parameters after the update, local_steps.py, declare across_workers=False)."""
        return self.local.after_update(copies)

    @property
    def state_variables(self):
        return self.local.state_variables

    def rejoined(self, copies) -> None:
        self.local.rejoined(copies)

    def global_model(self, copies):
        """The local stage's model (this worker's copies: the methods whose copies differ run
        at the nodes, NodeLevel, and say what they can build without a collective)."""
        return self.local.global_model(copies)

    def global_model_name(self) -> str:
        return self.local.global_model_name()

    def node_copies(self, copies):
        return self.local.node_copies(copies)

    def error_bound(self, options, num_towers):
        return self.local.error_bound(options, num_towers)

    def error_bound_for(self, options, num_towers, num_elements):
        return self.local.error_bound_for(options, num_towers, num_elements)

    def all_workers_sum(self, value: tf.Tensor) -> tf.Tensor:
        """sum over workers of `value` (on this worker's copy 0 device): one collective."""
        if self.cluster.num_workers == 1:
            return value
        with tf.device(self.device):
            return tf.raw_ops.CollectiveReduceV2(
                input=value, group_size=self.cluster.num_workers, group_key=self.group_key,
                instance_key=new_worker_instance_key(), ordering_token=[self.ordering_token.handle],
                merge_op="Add", final_op="Id", communication_hint="auto")

    def all_workers_sum_packed(self, values: list[tf.Tensor],
                               num_state: int = 0) -> list[tf.Tensor]:
        """sum over workers of each of `values`, on the copy 0 device: one collective per
        dtype, each counted as 2(W-1)/W of its bytes sent and received by this worker,
        between nodes (each worker is a node); the bytes of the last `num_state` values
        (the step's metrics) as state, the messages with the gradients."""
        workers = self.cluster.num_workers
        buckets = packing.plan_by_dtype(values)
        totals = []
        messages = 2 * (workers - 1)
        for bucket, flat in zip(buckets, packing.pack(values, buckets, self.device)):
            state = sum(values[i].shape.num_elements() for i in bucket
                        if i >= len(values) - num_state)
            gradient = flat.shape.num_elements() - state
            self._count(gradient, flat.dtype, messages)  # the messages ride with the gradients
            with self.traffic.counting_state():
                self._count(state, flat.dtype, 0 if gradient else messages)
            totals.append(self.all_workers_sum(flat))
        return packing.unpack(totals, buckets, [v.shape for v in values], self.device)

    def _count(self, elements: int, dtype: tf.DType, messages: int) -> None:
        """This worker's share of a ring all-reduce of `elements` between the workers."""
        if elements:
            workers = self.cluster.num_workers
            num_bytes = elements * dtype.size * 2 * (workers - 1) // workers
            self.traffic.add(canonical(self.device), sent=num_bytes, received=num_bytes,
                             messages_sent=messages, messages_received=messages,
                             tier="between")

    def reduce(self, tower_values, variables, average=True):
        return self.reduce_with_metrics(tower_values, variables, average, [])[0]

    def reduce_with_metrics(self, tower_values, variables, average, metrics):
        """Local sums and this worker's `metrics` in one collective (per dtype) between
        workers; or, when the method itself exchanges between the workers (at the nodes:
        between_nodes.py, peers.py), its result and the metrics in a collective of their own."""
        if self.local.exchanges_between_workers:
            out = self.local.reduce(tower_values, variables, average)
            if not metrics:
                return out, []
            return out, self.all_workers_sum_packed(list(metrics), len(metrics))
        local_sums = self.local.reduce(tower_values, variables, average=False)[0]
        summed = self.all_workers_sum_packed(list(local_sums) + list(metrics), len(metrics))
        with tf.device(self.device):
            totals = [self.scale(total, average) for total in summed[:len(local_sums)]]
        out = [totals]
        for copy_device in self.parameter_devices()[1:]:
            out.append([self.send(t, self.device, copy_device) for t in totals])
        return out, summed[len(local_sums):]

    def broadcast_from_chief(self, variables: list[tf.Variable]) -> None:
        """Makes `variables` equal to worker 0's: a sum to which only the chief contributes
        (one collective per dtype)."""
        chief = tf.constant(1.0 if self.cluster.is_chief else 0.0)
        mine = []
        for variable in variables:
            with tf.device(variable.device):
                value = variable.read_value()
                mine.append(value * tf.cast(chief, value.dtype))
        counted = self.traffic.snapshot()  # start-up, not a step: keep the step's counts
        for variable, value in zip(variables, self.all_workers_sum_packed(mine)):
            variable.assign(value)
        self.traffic.restore(counted)


class ShardedCrossWorker(ShardsUpdate, CrossWorker):
    """--shard_update across workers: each worker's copies split the update as the local
    method does in one process (its chunks, its reduce-scatter and all-gather), and between
    the reduce-scatter and the update the W copies holding chunk k (copy c of every worker)
    add their workers' sums of it in one collective of their own, scaled by 1/(W T) after:
    sharded within a worker, replicated across workers (FSDP's hybrid sharding). Each of the
    T collectives is counted as a ring between the workers, on its copy's device."""

    def __init__(self, local: Aggregation, cluster: Cluster):
        super().__init__(local, cluster)
        devices = local.parameter_devices()
        self.chunk_group_keys = [new_worker_group_key() for _ in devices]
        self.chunk_tokens = []  # copy 0's device: the stage's own token (its metrics' sum)
        for device in devices:
            with tf.device(device):
                self.chunk_tokens.append(
                    self.ordering_token if device == self.device else
                    tf.Variable(0.0, trainable=False, name="cross_worker_chunk_token"))

    def shard_sizes(self, num_elements):
        return self.local.shard_sizes(num_elements)

    def owned_shard(self, copy):
        return self.local.owned_shard(copy)

    def reduce_scatter(self, flats, average):
        workers = self.cluster.num_workers
        out = []
        for device, chunk, key, token in zip(self.local.parameter_devices(),
                                             self.local.reduce_scatter(flats, False),
                                             self.chunk_group_keys, self.chunk_tokens):
            num_bytes = chunk.shape.num_elements() * chunk.dtype.size * 2 * (workers - 1) \
                // workers
            self.traffic.add(canonical(device), sent=num_bytes, received=num_bytes,
                             messages_sent=2 * (workers - 1),
                             messages_received=2 * (workers - 1), tier="between")
            with tf.device(device):
                total = tf.raw_ops.CollectiveReduceV2(
                    input=chunk, group_size=workers, group_key=key,
                    instance_key=new_worker_instance_key(), ordering_token=[token.handle],
                    merge_op="Add", final_op="Id", communication_hint="auto")
                out.append(self.scale(total, average))
        return out

    def all_gather(self, chunks):
        return self.local.all_gather(chunks)  # every worker holds the same updated chunks

    def sum_metrics(self, metrics):
        return self.all_workers_sum_packed(list(metrics), len(metrics)) if metrics else []
