"""How a step's examples split among workers and towers: every leaf of a batch (x, y)
along its batch dimension, into contiguous parts, tower 0 first.

Every staging mode (staging.py) hands the towers these parts; a worker's input
pipeline keeps its own part (`worker_part`, inputs.py), and with gradient
accumulation each tower holds its shard of every micro-batch (`tower_split`).
"""

from __future__ import annotations

import tensorflow as tf

# (x_t, y_t) per tower, on tower t's device; x and y nested structures (a tensor, a tuple,
# a dict of tensors), every leaf split along the batch dimension alike
Shards = list[tuple]


def tower_split(x: tf.Tensor, towers: int, micro_batches: int = 1) -> list[tf.Tensor]:
    """Tower t's part of a step's examples x [K*B, ...] (K = micro_batches).

    K = 1: T equal contiguous shards, tower 0 first. K > 1 (accumulation): x is
    K global batches of B concatenated, and tower t gets the t-th shard of B/T of
    each of them, in order ([K*B/T, ...]), so that micro-batch k is the k-th
    micro-shard of every tower.
    """
    if micro_batches == 1:
        return tf.split(x, towers)
    grouped = tf.reshape(x, [micro_batches, towers, -1, *x.shape[1:]])
    swapped = tf.transpose(grouped, [1, 0, *range(2, grouped.shape.rank)])  # [T, K, B/T, ...]
    per_tower = tf.reshape(swapped, [towers, -1, *x.shape[1:]])
    return tf.unstack(per_tower, num=towers)


def worker_part(x: tf.Tensor, workers: int, index: int, micro_batches: int = 1) -> tf.Tensor:
    """Worker `index`'s part of a step's examples x [K*B, ...]: for each of the K
    global batches, its contiguous B/W slice ([K*B/W, ...]). Its towers then split
    it with `tower_split`, so global tower w*T + t gets what tower w*T + t of one
    process with W*T towers would."""
    grouped = tf.reshape(x, [micro_batches, workers, -1, *x.shape[1:]])
    return tf.reshape(grouped[:, index], [-1, *x.shape[1:]])


def nested_split(batch, towers: int, micro_batches: int = 1) -> list:
    """`tower_split` of every leaf of a nested batch: per tower, the same structure."""
    leaves = [tower_split(leaf, towers, micro_batches) for leaf in tf.nest.flatten(batch)]
    return [tf.nest.pack_sequence_as(batch, [parts[t] for parts in leaves])
            for t in range(towers)]


def split_to_towers(x, y, devices: list[str], micro_batches: int = 1) -> Shards:
    """The towers' parts of (x, y) (`tower_split` of every leaf), each copied to its tower."""
    parts = nested_split((x, y), len(devices), micro_batches)
    shards = []
    for device, part in zip(devices, parts):
        with tf.device(device):
            shards.append(tf.nest.map_structure(tf.identity, part))
    return shards
