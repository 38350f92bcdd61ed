"""Sizes first: sparse payloads whose length the data decides, gathered at run-time sizes.

For a compressor whose payload p_{s,i} = (values, indices) of variable i on sender s has a
data-dependent count k_{s,i} (threshold.py: the entries with |x| >= v), over S senders (this
process's towers, the simulated nodes' leaders, or one leader per worker: peers.py):

  1. sizes: every sender's counts k_s = [k_{s,0} .. k_{s,V-1}] (int32, 4 V bytes) are
     all-gathered (transport.ring_all_gather: a static shape, counted when traced), so
     every sender knows M_i = max_s k_{s,i} for every variable.
  2. payloads: sender s pads each variable's values (at --transport_dtype, a_v bytes) and
     indices (the narrowest integer type for n_i, a_i bytes: bitpacking.index_dtype) with
     zeros to M_i entries and sends the bytes of all its variables as ONE buffer of
         L = sum_i M_i (a_v + a_i) bytes,
     the same L for every sender. It is all-gathered: in one process by the ring (tower t
     forwards to t+1, T-1 hops), between workers by one CollectiveGatherV2, which needs equal
     shapes on every participant (hence the padding to the max: TF's collective gather has no
     variable-size variant), padded to whole int32s. The simulated ring sends the same
     padded buffers, so that simulated nodes move what real workers move.
  3. decode: every tower reads each sender's buffer, keeps its first k_{s,i} values and
     indices of each variable (the padding never enters a sum) and scatter-adds them into
     one zero accumulator per variable in global sender order 0 .. S-1: the same
     operations on the same bits on every tower, so the replicas are bit-identical, and
     two real workers bit-equal to two simulated nodes. Towers of one device
     (--towers_per_device) receive the very same tensors: the first forms M and the sums,
     the others take them (transport.shares_with; the trace stays linear in T).

Bytes. What travels is counted, padding included. Per participant and step, sent and
received alike (S-1 hops of each message in a ring all-gather):

    (S-1) (4 V + L)                      between the towers or simulated nodes of one process
    (S-1) (4 V + 4 max(ceil(L/4), 1))    between S workers (peers.py's int32 words)

in 2 (S-1) messages (one sizes message and one payload message per hop for the whole
model: `--pack_bytes` does not apply). The sizes are counted when traced; L only when the
step runs (aggregation/measured.py: int64 totals per device, read as the run's mean per
step by the link report). The dense size is never counted: a step in which fewer entries
pass moves fewer bytes.
"""

from __future__ import annotations

import tensorflow as tf

from mgloop.aggregation.compression.transport import ring_all_gather, shares_with
from mgloop.aggregation.kernels import bitpacking

SIZES_FIRST = "sizes first"


def _on_wire(method, part: tf.Tensor) -> tf.Tensor:
    """Floats at --transport_dtype (exact: payloads are rounded to it before), else as is."""
    wire = method.transport_dtype
    return tf.cast(part, wire) if part.dtype.is_floating and part.dtype != wire else part


def _wire_dtypes(method, encoded) -> list[tuple[tf.DType, tf.DType]]:
    """(values, indices) dtypes on the wire, per variable."""
    return [tuple(_on_wire(method, p).dtype for p in e.wires[0]) for e in encoded]


def counts_of(encoded, tower: int) -> tf.Tensor:
    """[V] int32: the entries tower `tower` sends of each variable (on its device)."""
    return tf.stack([tf.size(e.wires[tower][1], out_type=tf.int32) for e in encoded])


def padded_buffer(method, encoded, tower: int, most: tf.Tensor) -> tf.Tensor:
    """The bytes tower `tower` sends: per variable, its values then its indices, each padded
    with zeros to most[i] entries (on its device)."""
    parts = []
    for i, e in enumerate(encoded):
        for part in e.wires[tower]:
            part = _on_wire(method, part)
            parts.append(tf.pad(part, [[0, most[i] - tf.size(part)]]))
    return bitpacking.to_bytes(parts)


def _gather_buffers(method, buffers: list, towers: list) -> list[list]:
    """have[t][s]: sender s's buffer on tower t (one tower per process with peers)."""
    if method.peers is not None:
        return [method.peers.all_gather_bytes(method.traffic, buffers[0], method.measured,
                                              method.steps[0].read_value())]
    num = len(towers)
    have = [[None] * num for _ in range(num)]
    for t in range(num):
        have[t][t] = buffers[t]
    for step in range(num - 1):  # transport.ring_all_gather's ring, counted when run
        for src in range(num):
            dst, origin = (src + 1) % num, (src - step) % num
            have[dst][origin] = method.measured.send(method.traffic, have[src][origin],
                                                     towers[src], towers[dst])
    return have


def _decode(raws: list, most: tf.Tensor, counts: list, dtypes, sites) -> list[list]:
    """out[s][i]: (values, indices) of variable i in sender s's buffer (`raws`, each padded
    to the same most[i] entries of each variable): its first counts[s][i], values as
    sites[i]'s dtype, indices as scatters take them. The senders' buffers are split and
    reinterpreted as one [S, bytes] batch; each sender's entries are then its row's first."""
    pieces = tf.split(tf.stack(raws), tf.reshape(_piece_sizes(most, dtypes), [-1]),
                      num=2 * len(dtypes), axis=1)
    rows = [tf.unstack(_from_piece(piece, dtype))
            for piece, dtype in zip(pieces, [d for pair in dtypes for d in pair])]
    out = []
    for s, sender_counts in enumerate(counts):
        kept = tf.unstack(sender_counts, num=len(dtypes))
        out.append([(tf.cast(rows[2 * i][s][:kept[i]], sites[i].dtype),
                     bitpacking.unpack_indices(rows[2 * i + 1][s][:kept[i]], sites[i].size))
                    for i in range(len(dtypes))])
    return out


def _piece_sizes(most: tf.Tensor, dtypes) -> tf.Tensor:
    """[2 V] int32: the bytes of each padded part, in buffer order."""
    widths = tf.constant([[v.size, i.size] for v, i in dtypes], tf.int32)
    return most[:, None] * widths


def _from_piece(piece: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """[S, n]: the `dtype` tensors whose bytes the rows of `piece` ([S, bytes] uint8) hold."""
    if dtype == tf.uint8:
        return piece
    if dtype.size == 1:
        return tf.bitcast(piece, dtype)
    return tf.bitcast(tf.reshape(piece, [piece.shape[0], -1, dtype.size]), dtype)


def combine(method, encoded) -> list[list[tf.Tensor]]:
    """totals[i][t]: sum_s c_{s,i} on tower t, flat (module docstring), for every variable
    i of `encoded` (Compressed.encode; wires (values, packed indices) of run-time length)."""
    towers = list(method.devices.towers)
    counts = []
    for t, device in enumerate(towers):
        with tf.device(device):
            counts.append((counts_of(encoded, t),))
    have_counts = ring_all_gather(method, counts, towers, exact=True)
    dtypes = _wire_dtypes(method, encoded)
    mosts, buffers = [], []
    for t, (device, shared) in enumerate(zip(towers, shares_with(towers, have_counts))):
        with tf.device(device):
            mosts.append(mosts[shared] if shared is not None else
                         tf.reduce_max(tf.stack([c[0] for c in have_counts[t]]), axis=0))
            buffers.append(padded_buffer(method, encoded, t, mosts[t]))
    have = _gather_buffers(method, buffers, towers)
    totals = [[None] * len(towers) for _ in encoded]
    shared_by = shares_with(towers, [[(raw,) for raw in row] for row in have])
    for t, (device, shared) in enumerate(zip(towers, shared_by)):
        if shared is not None:  # a tower of the same device, the same received tensors
            for i in range(len(encoded)):
                totals[i][t] = totals[i][shared]
            continue
        with tf.device(device):
            sums = [tf.zeros([e.sites[t].size], e.sites[t].dtype) for e in encoded]
            for sender in _decode(have[t], mosts[t], [c for (c,) in have_counts[t]], dtypes,
                                  [e.sites[t] for e in encoded]):  # in tower order
                for i, (values, index) in enumerate(sender):
                    sums[i] = tf.tensor_scatter_nd_add(sums[i], tf.expand_dims(index, 1), values)
            for i, total in enumerate(sums):
                totals[i][t] = total
    return totals
