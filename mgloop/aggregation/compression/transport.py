"""How a compressed payload travels between the T towers of one worker.

A payload is a tuple of tensors, one per tower, on that tower's device.

Summable (`SUMMABLE`): the payload of every tower has the same shapes and its
decompression is linear in it (random-k with shared indices, factors, values with
a shared scale), so sum_t decompress(p_t) = decompress(sum_t p_t). Each part is
summed by the hand-written ring all-reduce (ring.py): every tower sends and
receives 2 (T-1)/T of the part's bytes, and every tower holds the same sum.

Gather (`GATHER`): payloads differ per tower in what they mean (top-k: each tower
picks its own indices), so they cannot be added. `ring_all_gather` passes them
around the ring t -> t+1: at step s (0 <= s < T-1) tower t forwards the payload
of tower (t - s) mod T, which it has, to tower t+1. After T-1 steps every tower
holds every tower's payload; each tower sends and receives (T-1) payloads. Every
tower then decompresses all T payloads and adds them in tower order 0, 1, ..., T-1
with the same operations, so the replicas stay bit-identical.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

SUMMABLE = "summable"
GATHER = "gather"


def ring_all_gather(method, payloads: Sequence[tuple], devices: Sequence[str],
                    exact: bool = False) -> list[list]:
    """have[t][s]: tower s's payload (a tuple of tensors) as present on devices[t].
    `exact`: floats travel at their own dtype, not --transport_dtype (`send`)."""
    if method.peers is not None:  # between worker processes: one collective (peers.py)
        return [_gather_from_peers(method, payloads, devices, exact)]
    num = len(devices)
    have = [[None] * num for _ in range(num)]
    for t in range(num):
        have[t][t] = tuple(payloads[t])
    for step in range(num - 1):
        for src in range(num):
            dst, origin = (src + 1) % num, (src - step) % num
            have[dst][origin] = tuple(method.send(part, devices[src], devices[dst], exact)
                                      for part in have[src][origin])
    return have


def _gather_from_peers(method, payloads, devices, exact: bool) -> list:
    """have[w] for this process's one tower: worker w's payload, floats through
    --transport_dtype as `send` sends them (not `exact`), its own as well, so that every
    worker holds the same bits of every payload (replicas that combine them agree)."""
    assert len(devices) == 1, "between workers the method has one tower per process"
    own = tuple(payloads[0])
    wire = method.transport_dtype
    with tf.device(devices[0]):
        cast = tuple(tf.cast(p, wire) if p.dtype.is_floating and not exact and p.dtype != wire
                     else p for p in own)
        have = method.peers.all_gather(method.traffic, cast)
        return [tuple(tf.cast(p, o.dtype) for p, o in zip(parts, own)) for parts in have]
