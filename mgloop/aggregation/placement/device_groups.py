"""Several towers per device (`--towers_per_device=K`): one variable copy per device.

With D devices and K towers on each (T = D K; towers d K .. d K + K - 1 on device d,
computed as one vectorized batch: vectorized_towers.py) the towers of a device share its
memory: they read one copy of the variables (a replicated layout keeps D copies, not T)
and nothing travels between them, so no byte is counted between them. What a method
does with the T towers' gradients depends on what it is:

    summable (ps_*, reduce_broadcast, ring, hierarchical, collective; element-wise linear,
    no state per variable): each device first forms its towers' exact mean
        m_d[v] = (1/K) sum_{k} g[d K + k][v]        (on device d, added in tower order)
    and the method runs on the D devices as its towers (`inner`, made on them):
        out = inner.reduce([m_0 .. m_{D-1}])  = (1/D) sum_d m_d = (1/T) sum_t g[t]
    (with --grad_reduce=sum the inner sum of the means is multiplied by K), so only the
    device means travel (packed in buckets of --pack_bytes, as the exchange would);
    every other method sees every tower's gradient (`inner` made on the T towers):
    robust aggregators gather every tower's gradient and send their result once per
    device (gather_at_root.py), and a method made per tower (a compressor's error
    feedback per tower) keeps its per-tower state; its outputs, one per tower, are
    identical for the towers of a device (a synchronous method gives every copy the same
    update), and the device's first tower's is its copy's. Such a method is allowed only
    on one device (validation: with several, its sends would be counted once per
    receiving tower, not per device).

Nodes compose with it from outside (between_nodes.py makes NodeLevel on the T towers; a node
holds whole devices). A node's sum (`node_sum`, its stage 1) is formed so too: each of
its devices adds its K towers' gradients there, as one sum over the leading axis of their
stacked rows (stacked_rows.py: the vectorized pass's own output, no copy),
    p_d[v] = sum_{k} g[d K + k][v]                 (on device d, over k in order)
and only p_d travels to the node's leader, which adds the devices' sums (two: a + b; more:
one sum over their stack, in device order). The order is fixed by the graph's structure,
not left to an AddN of many inputs: Grappler's arithmetic optimizer sorts an AddN's inputs
by their op names, which differ between simulated nodes (one graph) and workers (one each),
and a float sum of three or more terms depends on its order; so a worker's node mean has
the bits of the same simulated node's (tests/test_nodes_workers.py).
"""

from __future__ import annotations

import tensorflow as tf

from mgloop import aggregation
from mgloop.aggregation.base import Aggregation
from mgloop.aggregation.kernels import packing, stacked_rows
from mgloop.aggregation.placement.wrapper import Wrapper
from mgloop.cluster.devices import DeviceSet


def make(spec: str, devices: DeviceSet, transport_dtype: str, make_method,
         pack_bytes: int, cluster=None) -> Aggregation:
    """The method `spec` for the T towers of `devices` (K > 1 per device; module
    docstring): on the device means if summable; as made on the towers if it keeps one
    copy per device itself (`copies_per_device`); else inside `DeviceGroups`. `cluster`:
    the workers whose towers it also combines (cross_worker.py), if several."""
    method = aggregation.get(spec)
    if method.capabilities.summable and method.capabilities.exchanges:
        inner = make_method(spec, DeviceSet(devices.copy_devices, devices.host,
                                            devices.simulated), transport_dtype)
        return DeviceGroups(inner, devices, True, pack_bytes, cluster)
    if method.capabilities.copies_per_device:
        return make_method(spec, devices, transport_dtype, cluster=cluster)
    return DeviceGroups(make_method(spec, devices, transport_dtype), devices, False,
                        cluster=cluster)


class DeviceGroups(Wrapper):
    """`inner` for the T towers of `devices` (K per device): on the devices' means if
    `means`, else on every tower with one output kept per device."""

    def __init__(self, inner: Aggregation, devices, means: bool, pack_bytes: int = 0,
                 cluster=None):
        super().__init__(inner, devices, cluster)
        self.means, self.pack_bytes = means, pack_bytes
        # the exchange hands every tower's gradients; the means are packed here, if at all
        self.capabilities = self.capabilities.but(summable=False)

    def tower_values(self, tower, values):
        return values  # validation refuses methods whose towers read values of their own

    def step(self):
        return self.inner.step()

    def reduce(self, tower_values, variables, average=True):
        k = self.devices.towers_per_device
        if not self.means:
            out = self.inner.reduce(tower_values, variables, average)
            return out if len(out) == 1 else out[::k]
        means = []
        for d, device in enumerate(self.devices.copy_devices):
            with tf.device(device):
                means.append([tf.add_n([tower_values[t][i] for t in range(d * k, d * k + k)])
                              * (1.0 / k) for i in range(len(variables))])
        out = self._packed_reduce(means, variables, average)
        if average:
            return out
        return [[value * float(k) for value in values] for values in out]

    def _packed_reduce(self, means, variables, average):
        """inner.reduce of the device means, in buckets of `pack_bytes` if set."""
        if not self.pack_bytes:
            return self.inner.reduce(means, variables, average)
        buckets = packing.plan(means[0], self.pack_bytes)
        packed = [packing.pack(m, buckets, device)
                  for m, device in zip(means, self.devices.copy_devices)]
        out = self.inner.reduce(packed, [variables[b[0]] for b in buckets], average)
        shapes = [v.shape for v in variables]
        return [packing.unpack(values, buckets, shapes, device)
                for values, device in zip(out, self.inner.parameter_devices())]


def node_sum(method: Aggregation, leader: str, values: list, devices: list[str]):
    """sum_t values[t] (values[t] on devices[t], a device's towers consecutive) on `leader`:
    each device's towers' values summed there, then the devices' sums on the leader (module
    docstring), each sent once (`method.send`, counted); rows (IndexedSlices) by `sum_on`."""
    if any(isinstance(value, tf.IndexedSlices) for value in values):
        return method.sum_on(leader, values, devices)
    partials, homes = [], []
    for first in range(len(values)):
        if first and devices[first] == devices[first - 1]:
            continue
        last = first + 1
        while last < len(values) and devices[last] == devices[first]:
            last += 1
        with tf.device(devices[first]):
            partials.append(values[first] if last == first + 1 else
                            tf.reduce_sum(stacked_rows.stack(values[first:last]), 0))
        homes.append(devices[first])
    received = [method.send(p, home, leader) for p, home in zip(partials, homes)]
    with tf.device(leader):
        if len(received) <= 2:  # a + b == b + a: no order to keep
            return received[0] if len(received) == 1 else tf.add_n(received)
        return tf.reduce_sum(tf.stack(received), 0)
