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

Nodes compose with it from outside (nodes.py makes NodeLevel on the T towers; a node
holds whole devices).
"""

from __future__ import annotations

import tensorflow as tf

from mgloop import aggregation as registry
from mgloop.aggregation import packing
from mgloop.aggregation.base import Aggregation
from mgloop.aggregation.wrapper import Wrapper
from mgloop.cluster.devices import DeviceSet


def make(spec: str, devices: DeviceSet, transport_dtype: str, make_method,
         pack_bytes: int) -> Aggregation:
    """The method `spec` for the T towers of `devices` (K > 1 per device; module
    docstring): on the device means if summable; as made on the towers if it keeps one
    copy per device itself (`copies_per_device`); else inside `DeviceGroups`."""
    method = registry.get(spec)
    if method.summable and method.exchanges:
        inner = make_method(spec, DeviceSet(devices.copy_devices, devices.host,
                                            devices.simulated), transport_dtype)
        return DeviceGroups(inner, devices, True, pack_bytes)
    inner = make_method(spec, devices, transport_dtype)
    return inner if inner.copies_per_device else DeviceGroups(inner, devices, False)


class DeviceGroups(Wrapper):
    """`inner` for the T towers of `devices` (K per device): on the devices' means if
    `means`, else on every tower with one output kept per device."""

    def __init__(self, inner: Aggregation, devices, means: bool, pack_bytes: int = 0):
        super().__init__(inner, devices)
        self.means, self.pack_bytes = means, pack_bytes
        # the exchange hands every tower's gradients; the means are packed here, if at all
        self.summable = False

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
