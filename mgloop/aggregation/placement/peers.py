"""Peers: the method under study between worker processes, one node leader per worker.

With W workers and the method at the nodes (between_nodes.py: each worker is a node), the
method is made on ONE tower in each process, its node's leader, and `method.peers`
says which of W it is. Its transport (ring.py's `ring_all_reduce`,
transport.py's `ring_all_gather`, gather_at_root.py) then moves values between the
processes with TensorFlow's collective ops over gRPC instead of between devices:

    all_gather(parts)   every worker's `parts` (a tuple of tensors of any dtype, the
                        same shapes on every worker), in worker order, on every worker.
                        The parts' bytes are concatenated (tf.bitcast to uint8, padded
                        to a multiple of 4) into ONE int32 buffer, gathered by one
                        CollectiveGatherV2 (its kernels take no 8- or 16-bit types), and
                        split back: so a step's packed payloads of every variable can
                        travel as one message (a bucket), and the bytes counted are the
                        bytes sent, padding included. A ring all-gather: each worker
                        sends and receives (W-1) buffers in W-1 messages each way.
    all_gather_bytes(raw)   the same for one uint8 buffer whose length the step decides
                        (equal on every worker: the caller's promise, e.g. a payload
                        padded to the largest size every worker gathered first): padded
                        to whole int32s (at least one), one CollectiveGatherV2, its
                        (W-1) padded buffers each way counted when the step runs
                        (measured.py). The runtime caches a collective's shape per
                        instance key within one call of a function (a compiled loop of
                        steps is one call), so its instance key is a run-time one:
                        a base per traced call site plus the exchange's index
                        (mod 2^16), the same on every worker.
    all_sum(value)      sum_w value_w on every worker: one CollectiveReduceV2 (merge
                        Add), a ring all-reduce: 2(W-1)/W of the bytes each way in
                        2(W-1) messages. Its order of additions is the runtime's: for
                        W = 2 it is a_0 + a_1 on both, bit for bit what the simulated
                        nodes' ring gives; for W > 2 a float sum differs from the
                        simulated ring's by the rounding of W terms (<= 2.4e-7 in the
                        weights after 4 steps of the MLP at W = 3: docs/results/workers.md). 8- and
                        16-bit integers (e.g. quantised codes), for which the collective
                        has no kernels, are gathered instead and added in worker order
                        (exact): (W-1) of their bytes each way.

Every count is `between` nodes (traffic.py). Group and instance keys come from
collective_keys.py's counters between workers (cross_worker.py's too), which every worker
advances in the same order because every worker builds and traces the same functions in
the same order (all_gather_bytes picks its instance key at run time from a block of
2^16); each Peers has an ordering token, so its collectives run in program order.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from mgloop.aggregation.kernels.bitpacking import from_bytes, to_bytes
from mgloop.aggregation.placement import collective_keys
from mgloop.cluster.devices import canonical

_NARROW = (tf.int8, tf.int16, tf.uint8, tf.uint16)  # no collective sum kernels: gathered


@dataclasses.dataclass
class Peers:
    """This worker's place among `num_workers` (worker `index`), on `device`."""

    num_workers: int
    index: int
    device: str
    group_key: int
    token: tf.Variable

    @classmethod
    def make(cls, cluster, device: str) -> "Peers":
        with tf.device(device):
            token = tf.Variable(0.0, trainable=False, name="peers_ordering_token")
        return cls(cluster.num_workers, cluster.index, device,
                   collective_keys.new_worker_group_key(), token)

    def _count(self, traffic, sent: int, received: int, messages: int) -> None:
        traffic.add(canonical(self.device), sent=sent, received=received,
                    messages_sent=messages, messages_received=messages, tier="between")

    def all_gather(self, traffic, parts: tuple) -> list[tuple]:
        """have[w]: worker w's `parts`, on this worker's device (module docstring)."""
        parts = tuple(tf.convert_to_tensor(p) for p in parts)
        with tf.device(self.device):
            raw = to_bytes(parts)
            total = raw.shape.num_elements()
            padded = -(-total // 4) * 4
            if padded > total:
                raw = tf.concat([raw, tf.zeros([padded - total], tf.uint8)], 0)
            words = tf.bitcast(tf.reshape(raw, [padded // 4, 4]), tf.int32)
            self._count(traffic, (self.num_workers - 1) * padded,
                        (self.num_workers - 1) * padded, self.num_workers - 1)
            gathered = tf.raw_ops.CollectiveGatherV2(
                input=words[None], group_size=self.num_workers, group_key=self.group_key,
                instance_key=collective_keys.new_worker_instance_key(),
                ordering_token=[self.token.handle], communication_hint="auto")
            return [from_bytes(
                tf.reshape(tf.bitcast(gathered[w], tf.uint8), [-1]), parts)
                for w in range(self.num_workers)]

    def all_gather_bytes(self, traffic, raw: tf.Tensor, measured,
                         exchange: tf.Tensor) -> list[tf.Tensor]:
        """have[w]: worker w's 1-D uint8 `raw`, of a run-time length equal on every worker,
        on this worker's device; bytes counted by `measured`; `exchange`: an integer scalar
        that differs between the exchanges of one call and is the same on every worker (the
        method's exchange count) (module docstring)."""
        key = collective_keys.new_run_time_keys()
        with tf.device(self.device):
            instance = key + tf.cast(tf.math.floormod(exchange, 1 << 16), tf.int32)
            length = tf.size(raw)
            padded = tf.maximum((length + 3) // 4, 1) * 4  # a gather of no element: one word
            raw = tf.concat([raw, tf.zeros([padded - length], tf.uint8)], 0)
            words = tf.bitcast(tf.reshape(raw, [-1, 4]), tf.int32)
            measured.collective(traffic, self.device,
                                tf.cast(padded, tf.int64) * (self.num_workers - 1),
                                self.num_workers - 1)
            gathered = tf.raw_ops.CollectiveGatherV2(
                input=words[None], group_size=self.num_workers, group_key=self.group_key,
                instance_key=instance, ordering_token=[self.token.handle],
                communication_hint="auto")
            return [tf.reshape(tf.bitcast(gathered[w], tf.uint8), [-1])[:length]
                    for w in range(self.num_workers)]

    def all_sum(self, traffic, value: tf.Tensor) -> tf.Tensor:
        """sum over workers of `value` (module docstring), on this worker's device."""
        given = value.dtype
        if given in _NARROW:  # no 8- or 16-bit integer kernels: gather, add in worker order
            have = self.all_gather(traffic, (value,))
            with tf.device(self.device):
                return _sum_in_order([parts[0] for parts in have], given)
        with tf.device(self.device):
            num_bytes = value.shape.num_elements() * value.dtype.size  # as sent
            share = num_bytes * 2 * (self.num_workers - 1) // self.num_workers
            self._count(traffic, share, share, 2 * (self.num_workers - 1))
            total = tf.raw_ops.CollectiveReduceV2(
                input=value, group_size=self.num_workers, group_key=self.group_key,
                instance_key=collective_keys.new_worker_instance_key(),
                ordering_token=[self.token.handle], merge_op="Add", final_op="Id",
                communication_hint="auto")
            return total


def _sum_in_order(values: list[tf.Tensor], dtype: tf.DType) -> tf.Tensor:
    """sum_w values[w], added in worker order in int32 (exact), as `dtype` (which the
    caller chose to hold the sum)."""
    total = tf.cast(values[0], tf.int32)
    for value in values[1:]:
        total = total + tf.cast(value, tf.int32)
    return tf.cast(total, dtype)

