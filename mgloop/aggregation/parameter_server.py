"""`ps_cpu`: one shared copy of the variables on the host CPU (parameter server).

Every tower reads the shared variables (an implicit copy to its device), computes
its gradients, and sends them to the CPU, where they are averaged,

    g[v] = (1/T) * sum_t g[t][v]      (on the CPU)

and applied once, by one optimizer whose state also lives on the CPU.
Per step each tower receives the variables and sends its gradients: with P
bytes of parameters, P bytes in and P bytes out per tower.
"""

from __future__ import annotations

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import SHARED, Aggregation


def mean_on(device: str, values: list[tf.Tensor]) -> tf.Tensor:
    """(1/len(values)) * sum(values), computed on `device`."""
    with tf.device(device):
        total = values[0] if len(values) == 1 else tf.add_n(values)
        return total * (1.0 / len(values))


@register
class ParameterServerCpu(Aggregation):
    name = "ps_cpu"
    layout = SHARED

    def parameter_devices(self):
        return [self.devices.host]

    def reduce(self, tower_values):
        device = self.devices.host
        return [[mean_on(device, list(per_var)) for per_var in zip(*tower_values)]]
