"""Gradient packing: fuse small tensors into buckets before the exchange (`--pack_bytes`).

Horovod's tensor fusion and tf_cnn_benchmarks' gradient repacking: an exchange
of many small tensors pays a fixed cost per tensor, so consecutive gradients
are flattened and concatenated into buckets of at most `pack_bytes` bytes,
each bucket is exchanged as one tensor, and the results are split back into
the original shapes. Buckets hold whole tensors of one dtype, in variable
order; a tensor larger than `pack_bytes` is a bucket by itself (never cut).
Packing changes no value: the exchange sums the same numbers element-wise.
The stage between workers (cross_worker.py) always packs, one bucket per dtype
(`plan_by_dtype`), since there a collective's fixed cost dwarfs its bytes.
"""

from __future__ import annotations

import tensorflow as tf

# The default --pack_bytes: chosen from `experiments/variants.py --vary pack_bytes=...` on
# mlp and big_mlp (docs/results/towers.md, "Packing by default"): with 4 towers it took
# ring's mlp step to 0.69-0.76x of unpacked and was neutral to 0.93x elsewhere.


def plan(values: list[tf.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of `values` per bucket, consecutive, each bucket <= bucket_bytes (or one tensor)."""
    buckets, current, size = [], [], 0
    for index, value in enumerate(values):
        nbytes = value.shape.num_elements() * value.dtype.size
        fits = size + nbytes <= bucket_bytes and (
            not current or values[current[0]].dtype == value.dtype)
        if current and not fits:
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def plan_by_dtype(values: list[tf.Tensor]) -> list[list[int]]:
    """Indices of `values` per dtype (one bucket each, of any size), in order of first appearance.

    The cross-worker stage's plan: the fewest collectives whatever `--pack_bytes` is."""
    buckets: dict[tf.DType, list[int]] = {}
    for index, value in enumerate(values):
        buckets.setdefault(value.dtype, []).append(index)
    return list(buckets.values())


def pack(values: list[tf.Tensor], buckets: list[list[int]], device: str) -> list[tf.Tensor]:
    """One 1-D tensor per bucket (its tensors flattened and concatenated in bucket order),
    on `device`."""
    with tf.device(device):
        return [tf.concat([tf.reshape(values[i], [-1]) for i in bucket], axis=0)
                for bucket in buckets]


def unpack(packed: list[tf.Tensor], buckets: list[list[int]], shapes: list[tf.TensorShape],
           device: str) -> list[tf.Tensor]:
    """Inverse of `pack`: the tensors in their original order and shapes, on `device`."""
    out = [None] * len(shapes)
    with tf.device(device):
        for flat, bucket in zip(packed, buckets):
            sizes = [shapes[i].num_elements() for i in bucket]
            for i, part in zip(bucket, tf.split(flat, sizes)):
                out[i] = tf.reshape(part, shapes[i])
    return out
