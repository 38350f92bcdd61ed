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
Collectives on one device are ordered by a per-device ordering token, so
that TensorFlow's automatic control dependencies do not serialise the
towers' collectives into a deadlock.
"""

from __future__ import annotations

import itertools

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import REPLICATED, Aggregation, canonical

_GROUP_KEYS = itertools.count(1)
_INSTANCE_KEYS = itertools.count(1)


def new_group_key() -> int:
    """A group key no other collective group of this process uses."""
    return next(_GROUP_KEYS)


def new_instance_key() -> int:
    """An instance key for one call site (the same on every member of the group)."""
    return next(_INSTANCE_KEYS)


def ordering_tokens(devices) -> list[tf.Variable]:
    """One ordering token per device: collectives on a device run in program order."""
    tokens = []
    for device in devices:
        with tf.device(device):
            tokens.append(tf.Variable(0.0, trainable=False, name="collective_ordering_token"))
    return tokens


class _AllReduceKernel(Aggregation):
    layout = REPLICATED
    compressed_transport = False  # the kernel sums in the dtype it is given

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
class Collective(_AllReduceKernel):
    name = "collective"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group_key = new_group_key()
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


@register
class Nccl(_AllReduceKernel):
    name = "nccl"
    device_kinds = ("gpu",)  # NCCL does not run on CPU devices

    def all_reduce(self, values, average):
        from tensorflow.python.ops import nccl_ops  # the public API has no NCCL entry point
        summed = nccl_ops.all_sum(values)
        out = []
        for device, total in zip(self.devices.towers, summed):
            with tf.device(device):
                out.append(self.scale(total, average))
        return out
