"""The aggregation interface: where variable copies live and how gradients meet.

Notation: T towers; tower t computes g[t][v], the gradient of the mean loss over
its shard (B/T examples of the global batch B) with respect to variable v. With
equal shards, the gradient of the mean loss over the global batch is

    g[v] = (1/T) * sum_t g[t][v]

and every aggregation returns exactly that (mean semantics), placed where each
variable copy lives, so the update is the one a single device would make.
"""

from __future__ import annotations

import abc
from typing import ClassVar, Sequence

import tensorflow as tf

from mgloop.devices import DeviceRequest, DeviceSet

SHARED = "shared"
REPLICATED = "replicated"

Gradients = list[tf.Tensor]


class Aggregation(abc.ABC):
    """One gradient-aggregation method. Subclass, set `name` and `layout`, register."""

    name: ClassVar[str]
    layout: ClassVar[str]  # SHARED: one variable copy; REPLICATED: one per tower

    def __init__(self, devices: DeviceSet):
        self.devices = devices

    @classmethod
    def check(cls, request: DeviceRequest) -> None:
        """Refuses (ConfigError) device requests this method cannot run on."""

    @abc.abstractmethod
    def parameter_devices(self) -> list[str]:
        """Devices holding the variable copies: one for SHARED, one per tower."""

    @abc.abstractmethod
    def reduce(self, tower_values: Sequence[Gradients]) -> list[Gradients]:
        """Averages per-tower values.

        Args:
          tower_values: tower_values[t][v], tower t's value for variable v,
            resident on tower t's device.
        Returns:
          out[c][v] = (1/T) * sum_t tower_values[t][v], placed on the device of
          variable copy c (len(out) == len(parameter_devices())).
        """
