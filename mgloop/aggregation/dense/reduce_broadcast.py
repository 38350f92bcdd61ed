"""`reduce_broadcast`: replicated variables; reduce on one device, broadcast the mean.

Every tower sends its gradients to tower 0's device, which computes

    g[v] = (1/T) * sum_t g[t][v]      (on tower 0)

and sends the same tensor back to every replica, so every replica applies
bit-identical updates and stays identical. Tower 0 receives (T-1)*P bytes
and sends (T-1)*P; every other tower sends P and receives P.
"""

from __future__ import annotations

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import REPLICATED, Aggregation
from mgloop.aggregation.capabilities import Capabilities


def reduce_then_broadcast(method: Aggregation, values, devices, average, root=None):
    """sum (or mean) of values[i] (on devices[i]) formed on `root`, then sent to every device."""
    root = root or devices[0]
    with tf.device(root):
        total = method.scale(method.sum_on(root, values, devices), average)
    return [method.send(total, root, device) for device in devices]


@register
class ReduceBroadcast(Aggregation):
    name = "reduce_broadcast"
    capabilities = Capabilities(layout=REPLICATED)

    def parameter_devices(self):
        return list(self.devices.towers)

    def reduce(self, tower_values, variables, average=True):
        towers = list(self.devices.towers)
        per_var = [reduce_then_broadcast(self, list(vals), towers, average)
                   for vals in zip(*tower_values)]
        return [list(per_device) for per_device in zip(*per_var)]
