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
from mgloop.aggregation.parameter_server import mean_on


@register
class ReduceBroadcast(Aggregation):
    name = "reduce_broadcast"
    layout = REPLICATED

    def parameter_devices(self):
        return list(self.devices.towers)

    def reduce(self, tower_values):
        root = self.devices.towers[0]
        means = [mean_on(root, list(per_var)) for per_var in zip(*tower_values)]
        out = []
        for device in self.devices.towers:
            with tf.device(device):
                out.append([tf.identity(m) for m in means])
        return out
