"""Peers: the method under study between worker processes, one node leader per worker.

With W workers and the method at the nodes (nodes.py: each worker is a node), the
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
    all_sum(value)      sum_w value_w on every worker: one CollectiveReduceV2 (merge
                        Add), a ring all-reduce: 2(W-1)/W of the bytes each way in
                        2(W-1) messages. Its order of additions is the runtime's; for
                        W = 2 it is a_0 + a_1 on both, bit for bit what the simulated
                        nodes' ring gives; for W > 2 the sums agree within the float
                        rounding of W terms (the tests' bound).

Every count is `between` nodes (traffic.py). Group and instance keys come from
cross_worker.py's counters, which every worker advances in the same order because
every worker builds and traces the same functions in the same order; each Peers has
an ordering token, so its collectives run in program order.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from mgloop.aggregation.base import canonical


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
        from mgloop.aggregation import cross_worker  # its key counters (it imports us)
        with tf.device(device):
            token = tf.Variable(0.0, trainable=False, name="peers_ordering_token")
        return cls(cluster.num_workers, cluster.index, device,
                   next(cross_worker._GROUP_KEYS), token)

    def _count(self, traffic, sent: int, received: int, messages: int) -> None:
        traffic.add(canonical(self.device), sent=sent, received=received,
                    messages_sent=messages, messages_received=messages, tier="between")

    def all_gather(self, traffic, parts: tuple) -> list[tuple]:
        """have[w]: worker w's `parts`, on this worker's device (module docstring)."""
        from mgloop.aggregation import cross_worker
        parts = tuple(tf.convert_to_tensor(p) for p in parts)
        with tf.device(self.device):
            pieces = [tf.reshape(tf.bitcast(p, tf.uint8), [-1]) if p.dtype.size > 1
                      else tf.reshape(tf.bitcast(p, tf.uint8) if p.dtype != tf.uint8 else p,
                                      [-1]) for p in parts]
            sizes = [p.shape.num_elements() * p.dtype.size for p in parts]
            total = sum(sizes)
            padded = -(-total // 4) * 4
            buffer = tf.concat(pieces + [tf.zeros([padded - total], tf.uint8)], 0)
            words = tf.bitcast(tf.reshape(buffer, [padded // 4, 4]), tf.int32)
            self._count(traffic, (self.num_workers - 1) * padded,
                        (self.num_workers - 1) * padded, self.num_workers - 1)
            gathered = tf.raw_ops.CollectiveGatherV2(
                input=words[None], group_size=self.num_workers, group_key=self.group_key,
                instance_key=next(cross_worker._INSTANCE_KEYS),
                ordering_token=[self.token.handle], communication_hint="auto")
            have = []
            for w in range(self.num_workers):
                raw = tf.reshape(tf.bitcast(gathered[w], tf.uint8), [-1])
                out, start = [], 0
                for p, size in zip(parts, sizes):
                    out.append(_from_bytes(raw[start:start + size], p))
                    start += size
                have.append(tuple(out))
            return have

    def all_sum(self, traffic, value: tf.Tensor) -> tf.Tensor:
        """sum over workers of `value` (module docstring), on this worker's device."""
        from mgloop.aggregation import cross_worker
        num_bytes = value.shape.num_elements() * value.dtype.size
        share = num_bytes * 2 * (self.num_workers - 1) // self.num_workers
        self._count(traffic, share, share, 2 * (self.num_workers - 1))
        with tf.device(self.device):
            return tf.raw_ops.CollectiveReduceV2(
                input=value, group_size=self.num_workers, group_key=self.group_key,
                instance_key=next(cross_worker._INSTANCE_KEYS),
                ordering_token=[self.token.handle], merge_op="Add", final_op="Id",
                communication_hint="auto")


def _from_bytes(raw: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """The tensor shaped and typed as `like` whose bytes are `raw` (uint8)."""
    if like.dtype.size == 1:
        flat = raw if like.dtype == tf.uint8 else tf.bitcast(raw, like.dtype)
    else:
        flat = tf.bitcast(tf.reshape(raw, [-1, like.dtype.size]), like.dtype)
    return tf.reshape(flat, like.shape)
