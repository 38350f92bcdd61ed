"""The transport of the methods that need every tower's whole gradient (`GatherAtRoot`).

Robust aggregators (median.py, trimmed_mean.py, krum.py, bulyan.py, geomedian.py) and
Adasum (adasum.py) are not sums of the towers' values: they compare whole tensors (or
the whole gradient vector). They gather and broadcast, the trusted-server model of the
Byzantine literature (Blanchard et al. 2017):

    tower t != 0 sends g[t][v] to tower 0          (send: --transport_dtype, counted)
    tower 0 computes out[v] = A(g[0], ..., g[T-1])[v]    (the method's `combine`)
    tower 0 sends out[v] to every other tower      (one tensor, so replicas stay identical)

so every replica applies the same bits. Bytes per step for P bytes of gradients: tower 0
receives and sends (T-1) P, every other tower sends P and receives P (as
reduce_broadcast.py). `combine` sees tower 0's copy of every tower's value, stacked in
tower order, and is computed once there.

Mean semantics: A estimates the mean gradient (1/T) sum_t g[t] (it equals it for T
identical gradients); with average=False (--grad_reduce=sum) the result is T * A, the
sum that estimate stands for. Not summable (no element-wise sum to ride a ring), not
across workers at the towers (the estimate needs every worker's towers' whole gradients in
one place); between workers at the nodes every worker gathers every node's gradient and
combines them itself (`_reduce_between_workers`).
"""

from __future__ import annotations

import abc
import dataclasses

import tensorflow as tf

from mgloop.aggregation.base import REPLICATED, Aggregation
from mgloop.aggregation.compression.transport import ring_all_gather
from mgloop.errors import ConfigError


class GatherAtRoot(Aggregation):
    """A method whose `combine` maps every tower's gradients (gathered on tower 0) to one
    gradient per variable, broadcast to every replica."""

    layout = REPLICATED
    exact = False
    summable = False
    runs_between_processes = True  # its transports reach other processes (peers.py)
    unsummable_reason = ("it compares every tower's whole gradients, gathered on tower 0 "
                         "(no element-wise sum to pack or ring-reduce)")
    across_workers = False

    def parameter_devices(self):
        return list(self.devices.towers)

    @abc.abstractmethod
    def combine(self, stacked: list[tf.Tensor]) -> list[tf.Tensor]:
        """stacked[v]: float tensor [T, *shape of v], row t tower t's gradient (on tower 0).
        Returns A(...)[v] for every v, shaped like v, on tower 0."""

    def reduce(self, tower_values, variables, average=True):
        if self.peers is not None:
            return self._reduce_between_workers(tower_values, average)
        towers = list(self.devices.towers)
        root = towers[0]
        received = [[self.send(g, device, root) for g in values]
                    for values, device in zip(tower_values, towers)]
        with tf.device(root):
            stacked = [tf.stack(per_var) for per_var in zip(*received)]
            combined = self.combine(stacked)
            if not average:
                combined = [x * float(self.num_towers) for x in combined]
        per_var = [[self.send(x, root, device) for device in towers] for x in combined]
        return [list(per_copy) for per_copy in zip(*per_var)]


    def _reduce_between_workers(self, tower_values, average):
        """Between worker processes (peers.py): every worker gathers every worker's
        gradients (one all-gather of all of them) and computes `combine` itself, from the
        same bits in the same order, so no broadcast follows: each worker sends and
        receives (W-1) P bytes."""
        device = self.devices.towers[0]
        have = ring_all_gather(self, [tuple(tower_values[0])], [device])[0]
        with tf.device(device):
            stacked = [tf.stack(per_var) for per_var in zip(*have)]
            combined = self.combine(stacked)
            if not average:
                combined = [x * float(self.num_towers) for x in combined]
        return [combined]


def flat_rows(stacked: list[tf.Tensor]) -> tf.Tensor:
    """[T, D]: row t tower t's whole gradient vector, every variable flattened in order."""
    num = stacked[0].shape[0]
    return tf.concat([tf.reshape(x, [num, -1]) for x in stacked], axis=1)


def refuse_towers(method, request, options, needed: str, valid: str) -> None:
    """One ConfigError line: `method` with `options` cannot run on request's tower count."""
    spec = method.name + "".join(
        (":" if i == 0 else ",") + f"{f.name}={getattr(options, f.name)}"
        for i, f in enumerate(dataclasses.fields(options)))  # every option, defaults too
    raise ConfigError(f"--aggregation={spec} needs {needed}; --devices gives "
                      f"{request.num_towers} towers: {valid}")
