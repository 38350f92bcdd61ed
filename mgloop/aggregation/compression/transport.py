"""How a compressed payload travels between the T towers of one worker, and what each
tower forms from what it received (`summed`, `gathered_sums`, `gathered_payload_sums`).

A payload is a tuple of tensors, one per tower, on that tower's device.

Summable (`SUMMABLE`): the payload of every tower has the same shapes and its
decompression is linear in it (random-k with shared indices, factors, values with
a shared scale), so sum_t decompress(p_t) = decompress(sum_t p_t). Each part is
summed by the hand-written ring all-reduce (ring.py): every tower sends and
receives 2 (T-1)/T of the part's bytes, and every tower holds the same sum.

Buckets (`gather_in_buckets`): the gathered wires of consecutive variables travel as one
message of their concatenated bytes, up to --pack_bytes per bucket (DDP's buckets).

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

from mgloop.aggregation.dense.ring import ring_all_reduce
from mgloop.aggregation.kernels import bitpacking
from mgloop.cluster.devices import canonical

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


def on_one_device(method, towers) -> bool:
    """Whether every tower of this process is on one device and no peer process takes
    part: `send` then moves nothing, and every tower receives the very same tensors."""
    return method.peers is None and len({canonical(d) for d in towers}) == 1


def buckets_of(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive positions grouped so that each group's sizes sum to at most `limit`
    (a size above it alone; limit 0: every position alone), as DDP's buckets."""
    out, total = [], 0
    for j, size in enumerate(sizes):
        if out and limit and total + size <= limit:
            out[-1].append(j)
            total += size
        else:
            out.append([j])
            total = size
    return out


def gather_in_buckets(method, encoded: list, indices: list[int]) -> dict:
    """{i: have[t][s]} for the variables `indices` whose wires (encoded[i].wires[t], a
    tuple of tensors per tower) are gathered: each bucket of consecutive ones
    (`method.bucket_bytes`, --pack_bytes) travels as ONE message, the bytes of its wires
    concatenated (bitpacking.to_bytes; floats at --transport_dtype, as `send` sends
    them, exactly: payloads are rounded to it before) and split back exactly; a bucket of
    one variable is sent part by part. The bytes are the same either way; fewer messages."""
    towers = list(method.devices.towers)
    wire = method.transport_dtype

    def on_wire(part):
        return tf.cast(part, wire) if part.dtype.is_floating and part.dtype != wire else part

    sizes = [sum(on_wire(p).dtype.size * p.shape.num_elements() for p in encoded[i].wires[0])
             for i in indices]
    # towers of one device (--towers_per_device) send nothing to each other: no buckets
    one_device = on_one_device(method, towers)
    have = {}
    for bucket in buckets_of(sizes, 0 if one_device else method.bucket_bytes):
        members = [indices[j] for j in bucket]
        if len(members) == 1:
            have[members[0]] = ring_all_gather(method, encoded[members[0]].wires, towers)
            continue
        likes = [on_wire(p) for i in members for p in encoded[i].wires[0]]
        fused = []
        for t, device in enumerate(towers):
            with tf.device(device):
                fused.append((bitpacking.to_bytes(
                    [on_wire(p) for i in members for p in encoded[i].wires[t]]),))
        got = ring_all_gather(method, fused, towers)
        for i in members:
            have[i] = [[None] * len(got[t]) for t in range(len(towers))]
        dtypes = [p.dtype for i in members for p in encoded[i].wires[0]]
        for t, device in enumerate(towers):
            with tf.device(device):  # the T messages a tower received split as one batch
                rows = bitpacking.from_bytes_rows(tf.stack([raw for (raw,) in got[t]]), likes)
                parts = iter([tf.unstack(tf.cast(part, dtype))
                              for part, dtype in zip(rows, dtypes)])
                for i in members:
                    split = [next(parts) for _ in encoded[i].wires[0]]
                    for s in range(len(got[t])):
                        have[i][t][s] = tuple(part[s] for part in split)
    return have


# --- what every tower forms from what it received --------------------------------------

def gather_is_cheaper(method, payload: tuple, wire: tuple) -> bool:
    """SUMMABLE: whether gathering the packed payloads moves fewer bytes than the ring's
    sum of the unpacked ones (module docstring)."""
    def size(parts):
        return sum(p.shape.num_elements() * p.dtype.size for p in parts)
    return (method.num_towers > 1 and size(wire) < size(payload)
            and method.num_towers * size(wire) < 2 * size(payload))


def shares_with(towers, have) -> list[int | None]:
    """Per tower t: an earlier tower whose total t can take as it is (None: t forms its
    own): one on the same device that received the very same tensors (towers of one
    device, --towers_per_device, where `send` moves nothing). Its total is the same ops on
    the same inputs, so the same bits; forming it once per device keeps the trace linear
    in T (T towers forming T sums each is T^2 ops per variable)."""
    first = {}
    out = []
    for t, device in enumerate(towers):
        key = (canonical(device), tuple(id(part) for wire in have[t] for part in wire))
        out.append(first.get(key))
        first.setdefault(key, t)
    return out


def stacked(wires) -> tuple:
    """The R wires a tower received, part by part: [R, ...] each (`unpack_rows`)."""
    return tuple(tf.stack(parts) for parts in zip(*wires))


def gathered_payload_sums(method, have, sites):
    """Every tower: decompress(sum_t unpack(w_t)), each part summed in tower order
    (have[t][s]: tower s's wire on tower t, `gather_in_buckets`)."""
    towers = list(method.devices.towers)
    totals = []
    for t, (device, shared) in enumerate(zip(towers, shares_with(towers, have))):
        if shared is not None:
            totals.append(totals[shared])
            continue
        with tf.device(device):
            parts = method.unpack_rows(stacked(have[t]), sites[t])
            summed = tuple(tf.reduce_sum(part, axis=0) for part in parts)
            totals.append(method.decompress(summed, sites[t]))
    return totals


def gathered_sums(method, have, sites):
    """Every tower: sum_s decompress(p_s) over s = 0..T-1, the same operations on the
    same values in the same order on every tower (replicas bit-identical)."""
    towers = list(method.devices.towers)
    totals = []
    for t, (device, shared) in enumerate(zip(towers, shares_with(towers, have))):
        if shared is not None:  # the same wires on the same device: the same total
            totals.append(totals[shared])
            continue
        with tf.device(device):
            payloads = method.unpack_rows(stacked(have[t]), sites[t])
            if method.sparse_payload:  # (values, int32 indices): scattered in tower order
                total = tf.zeros([sites[t].size], sites[t].dtype)
                for values, index in zip(*map(tf.unstack, payloads)):
                    total = tf.tensor_scatter_nd_add(total, tf.expand_dims(index, 1), values)
                totals.append(total)
                continue
            # every sender's term, its own too (decompressing its own wire gives the bits
            # of sent[t]: unpack(pack(p)) is p exactly), as one [T, n] batch
            terms = method.decompress_rows(payloads, sites[t])
            # One reduction over the stacked terms: the same kernel on the same [T, n]
            # input on every tower. (A chain of adds is regrouped by Grappler's
            # arithmetic optimizer differently per tower, changing the last bits.)
            totals.append(terms[0] if terms.shape[0] == 1 else tf.reduce_sum(terms, axis=0))
    return totals


def summed(method, payloads, sites):
    """Every tower: decompress(sum_t p_t), each part summed by the ring all-reduce."""
    towers = list(method.devices.towers)
    sums = [[] for _ in towers]
    one_device = len(towers) > 1 and on_one_device(method, towers)
    for j in range(len(payloads[0])):
        if one_device and payloads[0][j].dtype.is_integer:
            # towers of one device send nothing, and integers add exactly in any order: one
            # sum for them all, not the ring's T (T - 1) adds of chunks (the same bits)
            with tf.device(towers[0]):
                total = tf.reduce_sum(tf.stack([payload[j] for payload in payloads]), axis=0)
            for t in range(len(towers)):
                sums[t].append(total)
            continue
        flats = []
        for device, payload in zip(towers, payloads):
            with tf.device(device):
                flats.append(tf.reshape(payload[j], [-1]))
        for t, total in enumerate(ring_all_reduce(method, flats, towers, average=False)):
            with tf.device(towers[t]):
                sums[t].append(tf.reshape(total, payloads[t][j].shape))
    totals = []
    for t, device in enumerate(towers):
        with tf.device(device):
            totals.append(method.decompress(tuple(sums[t]), sites[t]))
    return totals
