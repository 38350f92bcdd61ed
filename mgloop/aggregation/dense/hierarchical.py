"""`hierarchical`: replicated variables; reduce in groups, all-reduce among leaders, broadcast.

The T towers are cut into G = `--aggregation=hierarchical:groups=G` contiguous groups of T/G
(tower order), the first tower of each group being its leader:

    1. inside each group, the leader sums its members' gradients;
    2. the G leaders all-reduce those sums with the chunked ring (ring.py);
    3. each leader scales the total by 1/T and sends it to its members.

This is the shape of tf_cnn_benchmarks' hierarchical copy: cheap links inside
a group (e.g. GPUs on one PCIe switch), few transfers between groups.

With --shard_update (shard_exchange.py) the halves are two-dimensional: each group
reduce-scatters its members' gradients around its own ring into S = T/G chunks (member p
holding chunk (p + 1) mod S of the group's sum), the G members holding the same chunk
all-reduce it around a ring of their own and scale it by 1/T, and after the update each
group all-gathers its chunks. A chunk's optimizer state is held once per group: G/T of it
per device (sharded within a group, replicated across groups, as FSDP's hybrid sharding).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import REPLICATED, Aggregation, Options, option
from mgloop.aggregation.capabilities import Capabilities
from mgloop.aggregation.dense.ring import (chunk_sizes, joined, owned_chunk, ring_all_gather,
                                           ring_reduce_scatter, sharded_ring_all_reduce)
from mgloop.aggregation.placement.shard_exchange import ShardsUpdate
from mgloop.errors import ConfigError


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class HierarchicalOptions(Options):
    groups: int = option(2, "contiguous groups of towers, each summed on its leader "
                            "(divides the towers)", low=1)


@register
class Hierarchical(ShardsUpdate, Aggregation):
    name = "hierarchical"
    capabilities = Capabilities(layout=REPLICATED)
    options_type = HierarchicalOptions

    @classmethod
    def check(cls, request, options):
        towers, groups = request.num_towers, options.groups
        if towers % groups:
            raise ConfigError(
                f"--aggregation=hierarchical:groups={groups}: {groups} groups do not divide the "
                f"{towers} towers; use groups= one of: {', '.join(map(str, divisors(towers)))}")

    def parameter_devices(self):
        return list(self.devices.towers)

    def groups(self) -> list[list[str]]:
        towers = list(self.devices.towers)
        size = len(towers) // self.options.groups
        return [towers[i:i + size] for i in range(0, len(towers), size)]

    def reduce(self, tower_values, variables, average=True):
        towers = list(self.devices.towers)
        groups = self.groups()
        leaders = [group[0] for group in groups]
        per_var = []
        for values in zip(*tower_values):
            by_device = dict(zip(towers, values))
            sums = [self.sum_on(group[0], [by_device[d] for d in group], group)
                    for group in groups]
            totals = sharded_ring_all_reduce(self, sums, leaders, 1, average=False)
            out = {}
            for group, total in zip(groups, totals):
                with tf.device(group[0]):
                    total = self.scale(total, average)
                for device in group:
                    out[device] = self.send(total, group[0], device)
            per_var.append([out[d] for d in towers])
        return [list(per_device) for per_device in zip(*per_var)]

    # --shard_update (shard_exchange.py): reduce-scatter in each group, all-reduce across
    def shard_sizes(self, num_elements):
        return chunk_sizes(num_elements, self.num_towers // self.options.groups)

    def owned_shard(self, copy):
        size = self.num_towers // self.options.groups
        return owned_chunk(copy % size, size)

    def reduce_scatter(self, flats, average):
        groups, size = self.groups(), self.num_towers // self.options.groups
        owned = []  # per group: its members' chunks of the group's sum
        for g, group in enumerate(groups):
            chunks = ring_reduce_scatter(self, flats[g * size:(g + 1) * size], group, False)
            owned.append([chunks[p][owned_chunk(p, size)] for p in range(size)])
        out = [None] * self.num_towers
        for p in range(size):  # the members holding the same chunk, one per group
            devices = [group[p] for group in groups]
            totals = sharded_ring_all_reduce(self, [chunks[p] for chunks in owned], devices,
                                             1, average=False)
            for g, (device, total) in enumerate(zip(devices, totals)):
                with tf.device(device):
                    out[g * size + p] = self.scale(total, average)
        return out

    def all_gather(self, chunks):
        size, out = self.num_towers // self.options.groups, []
        for g, group in enumerate(self.groups()):
            held = [[None] * size for _ in group]
            for p in range(size):
                held[p][owned_chunk(p, size)] = chunks[g * size + p]
            ring_all_gather(self, held, group)
            out += joined(held, group)
        return out
