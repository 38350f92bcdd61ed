"""Nearest-neighbour mixing (NNM), the pre-aggregation of every gathering robust method
(Allouah et al. 2023, "Fixing by mixing: a recipe for optimal Byzantine ML under
heterogeneity", AISTATS): `--aggregation=NAME:...,nnm=f`.

On the whole gradient vectors (x_t tower t's, every variable flattened and concatenated),
with T towers and f = nnm: N_t is the set of the T - f towers nearest to x_t among the T
(Euclidean distance; x_t itself always first, then by distance, ties to the lower index),
and every x_t is replaced by the mean of its neighbourhood,

    y_t = (1 / (T - f)) sum_{s in N_t} x_s          (summed in tower order),

the same weights for every variable; the method's own rule then runs on y_0..y_{T-1}
(gather_at_root.py: `GatherAtRoot.mix` before `combine`, in one process and between
workers alike). The paper requires T > 2f (nnm < T/2, refused otherwise before
building); with it, a rule robust to f Byzantine inputs of T (Krum, the geometric or
coordinate-wise median, the trimmed mean, ...) applied after NNM reaches the
order-optimal error under heterogeneity (the paper's main result).
nnm = 0 is off (the default), and the inputs pass untouched.

Each y_t is a mean of towers' gradients: per variable it lies in the towers' convex hull
(||y_t[v]|| <= G_v, G_v the largest ||x_t[v]||), and per element between the towers'
smallest and largest values; so a method's bound that rests on either property holds
after mixing unchanged. Only the methods' exact settings change: the mean of the y_t
is not the mean of the x_t (x_s counts as many times as it is a neighbour), so with
nnm > 0 it is a convex combination of the towers' gradients, within 2 G_v of the mean.
"""

from __future__ import annotations

import tensorflow as tf


# Up to this many rows the distances are formed from the differences (no cancellation);
# above, from one Gram matrix of the centred rows (T passes over [T, D] cost T^2 D
# subtractions: 234.5 ms for T = 64, D = 118k on a 2-core CPU against 11.4 ms for the
# product; `python -m experiments.towers kernels`).
DIFFERENCE_ROWS = 16


def squared_distances(rows: tf.Tensor) -> tf.Tensor:
    """[T, T]: ||rows[i] - rows[j]||^2, exactly 0 on the diagonal.

    T <= DIFFERENCE_ROWS: each formed from the difference rows[i] - rows[j] (float32
    rounding of a sum of D squares: within gamma(D) of the exact value, relatively).
    Larger T: from the Gram matrix G = C C^T of the rows centred on their mean,
    C = rows - mean (distances do not change under a translation, and centring keeps
    the terms as small as the spread of the rows): d_ij = G_ii + G_jj - 2 G_ij, clipped
    at 0, within 2 gamma(D + 2) (||c_i|| + ||c_j||)^2 of the exact value; two rows at
    distance 0 may so come out at up to that much, which can reorder ties only."""
    num = rows.shape[0]
    if num <= DIFFERENCE_ROWS:
        return tf.stack([tf.reduce_sum(tf.square(rows - rows[i]), axis=1)
                         for i in range(num)])
    centred = rows - tf.reduce_mean(rows, axis=0, keepdims=True)
    gram = tf.matmul(centred, centred, transpose_b=True)
    norms = tf.linalg.diag_part(gram)
    distances = tf.maximum(norms[:, None] + norms[None, :] - 2.0 * gram, 0.0)
    return tf.linalg.set_diag(distances, tf.zeros([num], distances.dtype))


def squared_distances_of(stacked: list[tf.Tensor]) -> tf.Tensor:
    """`squared_distances` of the rows of every x [T, ...] of `stacked` flattened and
    concatenated (gather_at_root.flat_rows); above DIFFERENCE_ROWS rows, formed variable
    by variable (the sum of each one's Gram distances, no concatenated copy)."""
    num = stacked[0].shape[0]
    blocks = [tf.reshape(x, [num, -1]) for x in stacked]
    if num <= DIFFERENCE_ROWS or len(blocks) == 1:
        return squared_distances(tf.concat(blocks, axis=1) if len(blocks) > 1 else blocks[0])
    return tf.add_n([squared_distances(block) for block in blocks])


def neighbourhoods(rows: tf.Tensor, f: int) -> tf.Tensor:
    """[T, T - f] int32: row t the indices of N_t (module docstring), ascending."""
    num = rows.shape[0]
    distances = squared_distances(rows)
    # itself first whatever ties at distance 0 (an identical tower of lower index)
    distances = tf.where(tf.eye(num, dtype=tf.bool), -1.0, distances)
    nearest = tf.argsort(distances, axis=1, stable=True)[:, :num - f]  # ties: lower index
    return tf.sort(nearest, axis=1)


def mix(stacked: list[tf.Tensor], rows: tf.Tensor, f: int) -> list[tf.Tensor]:
    """y[v] [T, *shape of v] for every stacked[v] [T, ...], given their flattened
    concatenation rows [T, D] (gather_at_root.flat_rows); f = 0 returns `stacked`."""
    if f == 0:
        return list(stacked)
    num = rows.shape[0]
    index = neighbourhoods(rows, f)
    return [tf.reduce_sum(tf.gather(x, index), axis=1) * (1.0 / (num - f)) for x in stacked]
