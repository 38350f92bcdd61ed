"""`collective` and `nccl`: TensorFlow's own all-reduce kernels among replicated variables.

    collective  CollectiveReduceV2 (merge Add, final Div for the mean), the op
                behind MultiWorkerMirroredStrategy; on CPUs TensorFlow runs it
                as a ring. The multi-process setting extends this same op
                across workers.
    nccl        NCCL all-reduce among GPU replicas (TensorFlow's NcclAllReduce);
                refused on machines without GPUs.

Both return (1/T) * sum_t g[t][v] on every replica. The traffic recorded is
the ring's, 2 (T-1)/T of the gradient bytes sent and received per device in
2 (T-1) messages each way, since these kernels run inside TensorFlow where
mgloop cannot count them.
With --shard_update (shard_exchange.py), `collective` splits the all-reduce into its
halves with TensorFlow's kernels: CollectiveAllToAllV2, after which copy c adds the T
pieces of its chunk c it received (AddN: one pass, in member order), and
CollectiveGatherV2 of the updated chunks. (TensorFlow 2.21 has no CPU kernel of
CollectiveReduceScatterV2, only NCCL's.)
Both split a tensor evenly, so the flat vector is padded to T equal chunks; the members'
ranks are the towers' order. TensorFlow's all-to-all confuses its members' keys from 11
members on (a key `1:1:0:0110` reused), so the sharded update takes at most 10 towers.
Collectives on one device are ordered by a per-device ordering token, so
that TensorFlow's automatic control dependencies do not serialise the
towers' collectives into a deadlock.
"""

from __future__ import annotations

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import REPLICATED, Aggregation, canonical
from mgloop.aggregation.capabilities import Capabilities
from mgloop.aggregation.placement.collective_keys import new_group_key, new_instance_key
from mgloop.aggregation.placement.shard_exchange import ShardsUpdate, equal_shard_sizes, padded_size



def ordering_tokens(devices) -> list[tf.Variable]:
    """One ordering token per device: collectives on a device run in program order."""
    tokens = []
    for device in devices:
        with tf.device(device):
            tokens.append(tf.Variable(0.0, trainable=False, name="collective_ordering_token"))
    return tokens


class _AllReduceKernel(Aggregation):
    capabilities = Capabilities(
        layout=REPLICATED,
        compressed_transport=False)  # the kernel sums in the dtype it is given

    def parameter_devices(self):
        return list(self.devices.towers)

    def record_ring_traffic(self, value: tf.Tensor) -> None:
        num = self.num_towers
        num_bytes = value.shape.num_elements() * value.dtype.size * 2 * (num - 1) // num
        tier = self.traffic.tier_of([canonical(d) for d in self.devices.towers])
        for device in self.devices.towers:
            self.traffic.add(canonical(device), sent=num_bytes, received=num_bytes,
                             messages_sent=2 * (num - 1), messages_received=2 * (num - 1),
                             tier=tier)

    def reduce(self, tower_values, variables, average=True):
        if self.num_towers == 1:
            return [list(tower_values[0])]
        per_var = []
        for values in zip(*tower_values):
            self.record_ring_traffic(values[0])
            per_var.append(self.all_reduce(list(values), average))
        return [list(per_device) for per_device in zip(*per_var)]


@register
class Collective(ShardsUpdate, _AllReduceKernel):
    name = "collective"
    most_sharded_towers = 10  # CollectiveAllToAllV2's keys are ambiguous from 11 members on

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group_key = new_group_key(self.cluster.index if self.cluster else 0)
        self.ordering_tokens = ordering_tokens(self.devices.towers)

    def all_reduce(self, values, average):
        instance_key = new_instance_key()
        out = []
        for device, value, token in zip(self.devices.towers, values, self.ordering_tokens):
            with tf.device(device):
                out.append(tf.raw_ops.CollectiveReduceV2(
                    input=value, group_size=self.num_towers, group_key=self.group_key,
                    instance_key=instance_key, ordering_token=[token.handle], merge_op="Add",
                    final_op="Div" if average else "Id", communication_hint="auto"))
        return out


    # --shard_update (shard_exchange.py): all-to-all and gather, on T equal padded chunks
    @classmethod
    def sharding_refusal(cls, options, num_towers):
        most = cls.most_sharded_towers
        if num_towers > most:
            return (f"takes at most {most} towers (TensorFlow's CollectiveAllToAllV2 confuses "
                    f"its members from {most + 1} on), not {num_towers}; use ring or "
                    "hierarchical")
        return None

    def shard_sizes(self, num_elements):
        return equal_shard_sizes(num_elements, self.num_towers)

    def owned_shard(self, copy):
        return copy  # the collective's rank of tower `copy`: the towers' order

    def _padded(self, value, total: int) -> tf.Tensor:
        missing = total - value.shape.num_elements()
        return tf.pad(value, [[0, missing]]) if missing else value

    def _record_chunks(self, size: int, dtype: tf.DType) -> None:
        """Each device sends and receives T-1 chunks of `size`, one message each."""
        num = self.num_towers
        num_bytes = (num - 1) * size * dtype.size
        tier = self.traffic.tier_of([canonical(d) for d in self.devices.towers])
        for device in self.devices.towers:
            self.traffic.add(canonical(device), sent=num_bytes, received=num_bytes,
                             messages_sent=num - 1, messages_received=num - 1, tier=tier)

    def reduce_scatter(self, flats, average):
        num, num_elements = self.num_towers, flats[0].shape.num_elements()
        size, sizes = padded_size(num_elements, num), self.shard_sizes(num_elements)
        self._record_chunks(size, flats[0].dtype)
        instance_key = new_instance_key()
        out = []
        for t, (device, flat, token) in enumerate(zip(self.devices.towers, flats,
                                                     self.ordering_tokens)):
            with tf.device(device):
                received = tf.raw_ops.CollectiveAllToAllV2(  # row m to member m, and back
                    input=tf.reshape(self._padded(flat, num * size), [num, size]),
                    group_size=num, group_key=self.group_key, instance_key=instance_key,
                    ordering_token=[token.handle], communication_hint="auto")
                # member m's chunk t in member order, added in one pass (AddN's fixed order)
                total = tf.add_n(tf.unstack(received))
                out.append(self.scale(total if sizes[t] == size else total[:sizes[t]],
                                      average))
        return out

    def all_gather(self, chunks):
        num = self.num_towers
        num_elements = sum(chunk.shape.num_elements() for chunk in chunks)
        size = padded_size(num_elements, num)
        self._record_chunks(size, chunks[0].dtype)
        instance_key = new_instance_key()
        out = []
        for device, chunk, token in zip(self.devices.towers, chunks, self.ordering_tokens):
            with tf.device(device):
                gathered = tf.raw_ops.CollectiveGatherV2(
                    input=self._padded(chunk, size), group_size=num, group_key=self.group_key,
                    instance_key=instance_key, ordering_token=[token.handle],
                    communication_hint="auto")
                out.append(gathered if num * size == num_elements else
                           gathered[:num_elements])
        return out


@register
class Nccl(_AllReduceKernel):
    name = "nccl"
    # NCCL does not run on CPU devices
    capabilities = _AllReduceKernel.capabilities.but(device_kinds=("gpu",))

    def all_reduce(self, values, average):
        from tensorflow.python.ops import nccl_ops  # the public API has no NCCL entry point
        summed = nccl_ops.all_sum(values)
        out = []
        for device, total in zip(self.devices.towers, summed):
            with tf.device(device):
                out.append(self.scale(total, average))
        return out
