"""The chunked orthonormal DCT-II of DeMo (Peng, Quesnelle & Kingma 2024, arXiv 2411.19870).

A tensor is viewed as a matrix [R, C]: a scalar as [1, 1], a vector of n entries as
[1, n], a tensor of rank >= 2 as [prod(shape[:-1]), shape[-1]] (the reference code,
github:bloc97/DeMo, takes only vectors and matrices). Each dimension is cut into chunks
of the largest divisor of its length that is <= `target` (the reference's
`_get_smaller_split`): r = split(R, target), c = split(C, target), so the matrix holds
(R/r)(C/c) chunks of E = r c entries, in row-major chunk order. Each chunk X (r x c)
goes to its coefficients

    Y = D_r X D_c^T,    D_N[k, i] = a_k cos(pi (2 i + 1) k / (2 N)),
                        a_0 = sqrt(1/N), a_k = sqrt(2/N) (k > 0)

(the orthonormal type-II DCT along both dimensions, norm="ortho"), computed as two
matrix products by the basis D_N (built in float64, rounded once to float32); the
inverse is X = D_r^T Y D_c (D_N is orthogonal). A chunk's E coefficients are flattened
row-major: coefficient (k_r, k_c) is entry k_r c + k_c.

Rounding (float32, u = 2^-24, gamma(n) = n u / (1 - n u), Higham ch. 3): one output of
a product by D_N is a dot product of N terms whose basis row has unit norm, so it is
within gamma(N + 1) ||x||_2 of the exact value (the basis' own rounding is the +1), and
the whole transform of one dimension within eps(N) = sqrt(N) gamma(N + 1) relative,
in the 2-norm. Exactly orthogonal transforms keep norms, so a chunk's transform along
both dimensions is within (1 + eps(r))(1 + eps(c)) - 1 relative, to first order in u.
`round_trip_bound` carries this through DeMo's lossless exchange.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import tensorflow as tf

from mgloop.aggregation.dense.hierarchical import divisors

U = 2.0 ** -24  # float32 unit roundoff


@functools.lru_cache(maxsize=None)
def split(n: int, target: int) -> int:
    """The largest divisor of n that is <= target (n, target >= 1); cached (a step's trace
    asks it for every variable on every tower)."""
    return max(d for d in divisors(n) if d <= target)


def matrix_shape(shape) -> tuple[int, int]:
    """[R, C] a tensor of `shape` is viewed as (module docstring)."""
    shape = [int(s) for s in shape]
    if not shape:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return math.prod(shape[:-1]), shape[-1]


def basis(n: int) -> np.ndarray:
    """D_n (float64): row k is the k-th orthonormal DCT-II vector."""
    k, i = np.arange(n)[:, None], np.arange(n)[None, :]
    scale = np.where(k == 0, math.sqrt(1.0 / n), math.sqrt(2.0 / n))
    return scale * np.cos(math.pi * (2 * i + 1) * k / (2 * n))


@dataclasses.dataclass(frozen=True)
class Chunking:
    """One tensor's chunks: the matrix [rows, cols] cut into chunks of r x c entries."""

    rows: int
    cols: int
    r: int
    c: int

    @classmethod
    def of(cls, shape, target: int) -> "Chunking":
        rows, cols = matrix_shape(shape)
        return cls(rows, cols, split(rows, target), split(cols, target))

    @property
    def chunks(self) -> int:
        return (self.rows // self.r) * (self.cols // self.c)

    @property
    def elements(self) -> int:
        """E: the entries (and coefficients) of one chunk."""
        return self.r * self.c

    def encode(self, x: tf.Tensor) -> tf.Tensor:
        """[chunks, E] coefficients of the flat x (rows * cols entries)."""
        d_r, d_c = self._bases(x.dtype)
        blocks = tf.reshape(x, [self.rows // self.r, self.r, self.cols // self.c, self.c])
        along_c = tf.einsum("yhxw,dw->yhxd", blocks, d_c)
        coefficients = tf.einsum("yhxd,bh->yxbd", along_c, d_r)
        return tf.reshape(coefficients, [self.chunks, self.elements])

    def decode(self, coefficients: tf.Tensor) -> tf.Tensor:
        """The flat tensor whose `encode` is `coefficients` ([chunks, E])."""
        d_r, d_c = self._bases(coefficients.dtype)
        blocks = tf.reshape(coefficients, [self.rows // self.r, self.cols // self.c,
                                           self.r, self.c])
        along_r = tf.einsum("yxbd,bh->yxhd", blocks, d_r)
        values = tf.einsum("yxhd,dw->yhxw", along_r, d_c)
        return tf.reshape(values, [self.rows * self.cols])

    def _bases(self, dtype):
        return (tf.constant(basis(self.r), dtype), tf.constant(basis(self.c), dtype))


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def transform_bound(n: int) -> float:
    """eps(n): one dimension's transform, relative in the 2-norm (module docstring)."""
    return math.sqrt(n) * gamma(n + 1)


def round_trip_bound(chunking: Chunking, num_towers: int) -> float:
    """rho with ||IDCT(mean_t DCT(g_t)) - mean_t g_t||_2 <= rho max_t ||g_t||_2 in float32:
    each chunk's DCT within e2 = (1 + eps(r))(1 + eps(c)) - 1 of the exact one, the mean of
    T coefficient vectors within gamma(T) (T - 1 additions and a division, elementwise,
    of terms each at most max_t ||g_t|| in norm), the IDCT within e2 again:
    rho = (1 + e2)^2 (1 + gamma(T)) - 1."""
    e2 = (1 + transform_bound(chunking.r)) * (1 + transform_bound(chunking.c)) - 1
    return (1 + e2) ** 2 * (1 + gamma(num_towers)) - 1
