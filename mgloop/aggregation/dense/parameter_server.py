"""The parameter-server family: one shared copy of the variables, read by every tower.

    ps_cpu     every variable on the host CPU
    ps_device  every variable on tower 0's device
    ps_spread  variables spread over the tower devices, each new variable on the
               device holding the fewest bytes so far (greedy balance by size, as
               tf_cnn_benchmarks' parameter-server device setter)

Every tower reads each variable from its device (P_v bytes), computes its
gradients, and sends each g[t][v] back to the device of v, where

    g[v] = (1/T) * sum_t g[t][v]      (on the device of v)

is formed and applied once, by one optimizer whose slots sit beside their
variables. A tower on the same device as a variable moves nothing for it. Between
worker processes at the nodes (peers.py), each worker's server copy adds the workers'
sums with one all-reduce, so every copy applies the same update.
"""

from __future__ import annotations

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import SHARED, Aggregation, canonical
from mgloop.aggregation.capabilities import Capabilities


class _ParameterServer(Aggregation):
    capabilities = Capabilities(
        layout=SHARED, sums_at_home=True,
        runs_between_processes=True)  # its transports reach other processes (peers.py)

    def parameter_devices(self):
        return [self.devices.host]

    def reduce(self, tower_values, variables, average=True):
        towers = self.devices.towers
        out = []
        for per_tower, variable in zip(zip(*tower_values), variables):
            home = self.home_of(variable)
            total = self.sum_on(home, per_tower, towers)
            if self.peers is not None:  # between workers: every worker's server copy
                total = self.peers.all_sum(self.traffic, total)  # gets the same sum
            with tf.device(home):
                out.append(self.scale(total, average))
        return [out]

    def home_of(self, variable) -> str:
        """The device where `variable`'s gradients meet: the variable's own."""
        return self.parameter_devices()[0]


@register
class ParameterServerCpu(_ParameterServer):
    name = "ps_cpu"


@register
class ParameterServerDevice(_ParameterServer):
    name = "ps_device"

    def parameter_devices(self):
        return [self.devices.towers[0]]


@register
class ParameterServerSpread(_ParameterServer):
    name = "ps_spread"
    capabilities = _ParameterServer.capabilities.but(
        summable=False,
        unsummable_reason="a bucket would fuse gradients of variables that live on different "
                          "devices")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.load = {canonical(d): 0 for d in self.devices.towers}  # bytes placed per device

    def parameter_devices(self):
        return [self.devices.towers[0]]  # the optimizer's step counter; variables are spread

    def variable_scope(self):
        def place(next_creator, **kwargs):
            device = min(self.devices.towers, key=lambda d: self.load[canonical(d)])
            with tf.device(device):
                variable = next_creator(**kwargs)
            self.load[canonical(device)] += variable.shape.num_elements() * variable.dtype.size
            return variable
        return tf.variable_creator_scope(place)

    def home_of(self, variable):
        return variable.device
