"""`ring`: replicated variables; a hand-written chunked ring all-reduce.

Each gradient tensor is flattened and cut into T contiguous chunks (sizes differ
by at most one element). Towers form a ring t -> t+1 (mod T).

Reduce-scatter, T-1 steps: at step s tower t sends chunk (t - s) mod T to tower
t+1, which adds it to its own copy of that chunk. After T-1 steps tower t holds
the sum over all towers of chunk (t + 1) mod T, and scales it by 1/T there.

All-gather, T-1 steps: at step s tower t sends the finished chunk
(t + 1 - s) mod T to tower t+1, which keeps it as is.

Every replica ends with the same tensors (each finished chunk is computed once
and copied), equal to (1/T) * sum_t g[t][v]. Each tower sends and receives
2 * (T-1)/T * P bytes per step for P bytes of gradients: the bandwidth-optimal
all-reduce, independent of T for large T.

`--aggregation=ring:shards=k` (tf_cnn_benchmarks' `xring#k`) cuts each tensor into k
contiguous shards and all-reduces each on its own ring: even shards go
forward t -> t+1, odd shards backward t -> t-1 (the other direction of every
link), each ring rotated by a different offset so that the chunk owners differ.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import REPLICATED, Aggregation, Options, option
from mgloop.aggregation.capabilities import Capabilities
from mgloop.aggregation.placement.shard_exchange import ShardsUpdate


def chunk_sizes(num_elements: int, num_chunks: int) -> list[int]:
    """Contiguous chunk sizes differing by at most one, larger chunks first."""
    base, extra = divmod(num_elements, num_chunks)
    return [base + 1 if i < extra else base for i in range(num_chunks)]


def ring_all_reduce(method: Aggregation, flats: list[tf.Tensor], devices: list[str],
                    average: bool) -> list[tf.Tensor]:
    """All-reduce of 1-D tensors flats[t] (on devices[t]) around the ring devices[0..T-1]
    (between worker processes, when the method has peers: their collective, peers.py)."""
    if method.peers is not None:
        return [peers_all_reduce(method, flats, devices, average)]
    chunks = ring_reduce_scatter(method, flats, devices, average)
    ring_all_gather(method, chunks, devices)
    return joined(chunks, devices)


def joined(chunks: list[list[tf.Tensor]], devices: list[str]) -> list[tf.Tensor]:
    """chunks[t] concatenated on devices[t], for every t."""
    out = []
    for device, parts in zip(devices, chunks):
        with tf.device(device):
            out.append(tf.concat(parts, axis=0))
    return out


def owned_chunk(tower: int, num: int) -> int:
    """The chunk tower `tower` holds finished after the reduce-scatter: (tower + 1) mod T."""
    return (tower + 1) % num


def ring_reduce_scatter(method: Aggregation, flats: list[tf.Tensor], devices: list[str],
                        average: bool) -> list[list[tf.Tensor]]:
    """The ring's first half: chunks[t][c] on devices[t], the T chunks of flats[t]
    (`chunk_sizes`), of which chunks[t][owned_chunk(t)] is now the sum over the towers of
    that chunk (scaled by 1/T if `average`); the others are partial sums."""
    num = len(devices)
    sizes = chunk_sizes(flats[0].shape.num_elements(), num)
    chunks = []
    for device, flat in zip(devices, flats):
        with tf.device(device):
            chunks.append(tf.split(flat, sizes))
    for step in range(num - 1):
        for src in range(num):
            dst, c = (src + 1) % num, (src - step) % num
            received = method.send(chunks[src][c], devices[src], devices[dst])
            with tf.device(devices[dst]):
                chunks[dst][c] = chunks[dst][c] + received
    for owner in range(num):
        c = owned_chunk(owner, num)
        with tf.device(devices[owner]):
            chunks[owner][c] = method.scale(chunks[owner][c], average)
    return chunks


def ring_all_gather(method: Aggregation, chunks: list[list[tf.Tensor]],
                    devices: list[str]) -> None:
    """The ring's second half, in place: each tower's owned chunk (`owned_chunk`) is passed
    on around the ring, T - 1 steps, until every chunks[t][c] is owner c - 1's."""
    num = len(devices)
    for step in range(num - 1):
        for src in range(num):
            dst, c = (src + 1) % num, (src + 1 - step) % num
            chunks[dst][c] = method.send(chunks[src][c], devices[src], devices[dst])


def peers_all_reduce(method: Aggregation, flats: list[tf.Tensor], devices: list[str],
                     average: bool) -> tf.Tensor:
    """This process's one tower's flats[0] summed over the workers (peers.py's all_sum, at
    the value's own dtype), scaled by 1/T if `average`."""
    assert len(devices) == 1, "between workers the method has one tower per process"
    total = method.peers.all_sum(method.traffic, flats[0])
    with tf.device(devices[0]):
        return method.scale(total, average)


def ring_order(devices: list[str], shard: int) -> list[int]:
    """Tower indices of ring number `shard`: alternate directions, rotate by shard // 2."""
    order = list(range(len(devices)))
    if shard % 2:
        order = order[::-1]
    offset = (shard // 2) % len(devices)
    return order[offset:] + order[:offset]


def sharded_ring_all_reduce(method: Aggregation, values: list[tf.Tensor], devices: list[str],
                            shards: int, average: bool) -> list[tf.Tensor]:
    """Mean (or sum) of values[t] (on devices[t]) over `shards` parallel rings."""
    num = len(devices)
    if method.peers is not None:
        return [tf.reshape(peers_all_reduce(method, [tf.reshape(values[0], [-1])], devices,
                                            average), values[0].shape)]
    if num == 1:
        return list(values)  # one tower: its value is the sum and the mean
    shape = values[0].shape
    shard_sizes = chunk_sizes(shape.num_elements(), shards)
    pieces = []
    for device, value in zip(devices, values):
        with tf.device(device):
            pieces.append(tf.split(tf.reshape(value, [-1]), shard_sizes))
    results = [[None] * shards for _ in range(num)]
    for shard in range(shards):
        order = ring_order(devices, shard)
        reduced = ring_all_reduce(method, [pieces[t][shard] for t in order],
                                  [devices[t] for t in order], average)
        for t, value in zip(order, reduced):
            results[t][shard] = value
    out = []
    for device, parts in zip(devices, results):
        with tf.device(device):
            out.append(tf.reshape(tf.concat(parts, axis=0), shape))
    return out


@dataclasses.dataclass(frozen=True)
class RingOptions(Options):
    shards: int = option(1, "parallel rings, each on a contiguous shard of every tensor, "
                            "alternating direction (tf_cnn_benchmarks' xring#k)", low=1)


@register
class Ring(ShardsUpdate, Aggregation):
    name = "ring"
    capabilities = Capabilities(
        layout=REPLICATED,
        # sharded_ring_all_reduce reaches other processes (peers.py)
        runs_between_processes=True)
    options_type = RingOptions

    def parameter_devices(self):
        return list(self.devices.towers)

    def reduce(self, tower_values, variables, average=True):
        devices = list(self.devices.towers)
        per_var = [sharded_ring_all_reduce(self, list(vals), devices,
                                           self.options.shards, average)
                   for vals in zip(*tower_values)]
        return [list(per_device) for per_device in zip(*per_var)]

    # --shard_update (shard_exchange.py): the ring's two halves, apart
    @classmethod
    def sharding_refusal(cls, options, num_towers):
        if options.shards > 1:
            return "the sharded update runs on one ring; use ring:shards=1 (the default)"
        return None

    def shard_sizes(self, num_elements):
        return chunk_sizes(num_elements, len(self.devices.towers))

    def owned_shard(self, copy):
        return owned_chunk(copy, len(self.devices.towers))

    def reduce_scatter(self, flats, average):
        towers = list(self.devices.towers)
        chunks = ring_reduce_scatter(self, flats, towers, average)
        return [chunks[t][self.owned_shard(t)] for t in range(len(towers))]

    def all_gather(self, chunks):
        towers = list(self.devices.towers)
        held = [[None] * len(towers) for _ in towers]
        for t, chunk in enumerate(chunks):
            held[t][self.owned_shard(t)] = chunk
        ring_all_gather(self, held, towers)
        return joined(held, towers)
