"""Order statistics along the towers' axis by a sorting network, compiled with XLA.

The coordinate-wise rules (median.py, trimmed_mean.py) need, for every element, the T
towers' values in order. `tf.sort(x, axis=0)` does that with one general sort per
element: for T = 64 and 118k elements, 130.6 ms on a 2-core CPU, more than a 64-tower
step of the mlp. A sorting network instead sorts every element at once with the same
fixed sequence of compare-exchanges on whole rows,

    (row_i, row_j) <- (min(row_i, row_j), max(row_i, row_j))      for each pair (i, j)

Batcher's odd-even merge sort (Knuth, TAOCP vol. 3, 5.3.4; the arbitrary-n form): about
n log2(n)^2 / 4 pairs (543 for n = 64). XLA fuses the chain into one loop over the
elements that keeps the T values in registers (for the median, only the compare-exchanges
the middle rows depend on): 3.9 ms for the same rows (`python
experiments/towers.py kernels`, side by side). min and max are exact, so the sorted rows
are exactly tf.sort's values: the median (a middle value, or the mean of the two) is
bit-identical to one formed from tf.sort; the trimmed mean adds the kept values in
ascending order (tf.reduce_sum of tf.sort's rows may add them in another: within float32
rounding).
"""

from __future__ import annotations

import functools

import tensorflow as tf


@functools.lru_cache(maxsize=None)
def batcher_pairs(n: int) -> tuple[tuple[int, int], ...]:
    """The compare-exchange pairs (i < j) of Batcher's odd-even merge sort of n rows."""
    pairs = []
    p = 1
    while p < n:
        k = p
        while k >= 1:
            for j in range(k % p, n - k, 2 * k):
                for i in range(min(k, n - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple(pairs)


def sorted_rows(x: tf.Tensor) -> list[tf.Tensor]:
    """x [T, ...] -> T tensors shaped like x[0]: every element's values in ascending order."""
    rows = tf.unstack(x, num=x.shape[0])
    for i, j in batcher_pairs(len(rows)):
        rows[i], rows[j] = tf.minimum(rows[i], rows[j]), tf.maximum(rows[i], rows[j])
    return rows


def _median(x: tf.Tensor) -> tf.Tensor:
    num = x.shape[0]
    if num <= 2:
        return tf.reduce_sum(x, 0) * (1.0 / num)
    rows = sorted_rows(x)
    if num % 2:
        return rows[num // 2]
    return (rows[num // 2 - 1] + rows[num // 2]) * 0.5


def _trimmed_mean(x: tf.Tensor, trim: int) -> tf.Tensor:
    num = x.shape[0]
    kept = sorted_rows(x)[trim:num - trim]
    total = kept[0]
    for row in kept[1:]:  # in ascending order, fused with the network
        total = total + row
    return total * (1.0 / (num - 2 * trim))


@tf.function(jit_compile=True)
def _median_rows(rows: tf.Tensor) -> tf.Tensor:
    return _median(rows)


@functools.lru_cache(maxsize=None)
def _trimmed_mean_rows(trim: int):
    return tf.function(lambda rows: _trimmed_mean(rows, trim), jit_compile=True)


def _per_row(statistic, stacked: list[tf.Tensor]) -> list[tf.Tensor]:
    """`statistic` of the rows [T, D] of every x [T, ...] of `stacked` flattened and
    concatenated (one network and one XLA compilation for all of them, not one per
    variable: compiling grows with the network's size), split back per x."""
    num = stacked[0].shape[0]
    if len(stacked) == 1 and stacked[0].shape.rank == 2:
        return [statistic(stacked[0])]
    flat = statistic(tf.concat([tf.reshape(x, [num, -1]) for x in stacked], axis=1))
    parts = tf.split(flat, [x.shape[1:].num_elements() for x in stacked])
    return [tf.reshape(part, x.shape[1:]) for part, x in zip(parts, stacked)]


def medians(stacked: list[tf.Tensor]) -> list[tf.Tensor]:
    """The coordinate-wise median along axis 0 of every x [T, ...] of `stacked` (T odd:
    the middle value; even: the mean of the two middle values)."""
    return _per_row(_median_rows, list(stacked))


def trimmed_means(stacked: list[tf.Tensor], trim: int) -> list[tf.Tensor]:
    """The mean along axis 0 of every x [T, ...] without its `trim` smallest and largest
    values per element (trim >= 1)."""
    return _per_row(_trimmed_mean_rows(trim), list(stacked))
