"""SparseLoCo's compressor C: chunk-wise top-k, values on a per-tensor codebook of 2^b bins.

Sarfi, Thérien, Lidin and Belilovsky 2025, "Communication Efficient LLM Pre-training with
SparseLoCo", arXiv 2508.15706; definitions read from its reference code (tplr-ai/SparseLoCo,
`src/tplr/sparseloco.py`: `ChunkingTransform`, `TopKCompressor`), not copied. The method
itself (error feedback, outer step) is sparseloco.py.

Chunks (`Geometry`). side = `chunk` (the reference's `chunk_size`, 64). d(n) = the largest
divisor of n that is <= side. A tensor of shape S is cut into equal chunks:

    ndim >= 2   as a matrix [R, C], R = prod(S[:-1]), C = S[-1]; h = d(R), w = d(C);
                chunk (a, b) holds rows a h .. a h + h - 1 and columns b w .. b w + w - 1,
                read row-major: L = h w entries (4096 for 64 x 64), chunks in order (a, b)
    ndim <= 1   n entries cut into chunks of L = d(n) consecutive entries

The reference chunks 2-D tensors so (DeMo's 2-D chunks) and refuses other ranks; mgloop
reads a kernel of rank > 2 (a convolution's) as the matrix [R, C] above.

Top-k. k = min(L, max(1, round(density L))) (Python's round, half to even, as the
reference's `round`); in every chunk the k entries of largest |e| (tf.math.top_k: in
decreasing order, ties to the lower index; torch.topk's order of ties is unspecified).
The kept values of the tensor, chunk by chunk in that order, are val[0..N-1], N = k x
chunks; idx[j, i] in [0, L) is the i-th kept entry's place in chunk j.

Quantiser (value_bits = b >= 1; the reference's "statistical quantization" with its
`quantization_bins` = 2^b and `quantization_range` = r = `sigmas`), per tensor, B = 2^b:

    mu    = S(val) * fl(1/N)                   the shift (mean)
    c     = val - mu
    sd    = sqrt(S(c * c)) * fl(1/sqrt(N - 1))  (0 if N = 1)
    s     = sd * fl(r / B), replaced by 1 if it is 0 or not finite
    q     = clip(round(c / s + B // 2), 0, B - 1)        round half to even
    book  = [mu, l_0 .. l_{B-1}],  l_j = S(c where q = j) / #{q = j}  (0 if none)
    C(val) = l_q + mu                                     what every node decodes

S(.) is a sum in a fixed order (`tree_sums`: padded with zeros to a power of two and
halved, x[:n/2] + x[n/2:], until one value is left), so every node and the numpy model in
tests/test_sparseloco.py add in the same order on any CPU. The reference divides by N,
sqrt(N - 1) and B where mgloop multiplies by the float32 constants above (TensorFlow's
graph optimiser would rewrite a division by a constant so anyway): the last bit may differ.
value_bits = 0: the kept values travel as float32, C(val) = val.

Wire of one tensor (`encode_many`, then `wire_bytes`): idx at w = max(1, ceil(log2 L)) bits each
(bitpacking.pack_bit_fields: 12 bits for L = 4096), ceil(N w / 8) bytes; then the codes at b
bits (bitpacking.pack_levels), ceil(N b / 8) bytes, and the book, 4 (B + 1) bytes; or with
b = 0 the values, 4 N bytes. (The reference sends int64 indices and uint8 codes; its own
templar network packs indices at 12 bits.)
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import tensorflow as tf

from mgloop.aggregation.kernels import bitpacking
F32 = np.float32


def largest_divisor(n: int, side: int) -> int:
    """The largest divisor of n (>= 1) that is at most `side` (the reference's
    `_get_smaller_split`)."""
    return max(d for d in range(1, min(n, side) + 1) if n % d == 0)


def kept(density: float, length: int) -> int:
    """k = min(L, max(1, round(density L))): the entries a chunk of L keeps."""
    return min(length, max(1, round(density * length)))


@dataclasses.dataclass(frozen=True)
class Geometry:
    """How a tensor of `shape` is cut into chunks (module docstring)."""

    shape: tuple
    rows: int  # R (1 for a vector)
    cols: int  # C (n for a vector)
    height: int  # h (1 for a vector)
    width: int  # w

    @classmethod
    def of(cls, shape, side: int) -> "Geometry":
        shape = tuple(int(s) for s in shape)
        if len(shape) >= 2:
            rows, cols = math.prod(shape[:-1]), shape[-1]
            return cls(shape, rows, cols, largest_divisor(rows, side),
                       largest_divisor(cols, side))
        n = math.prod(shape)
        return cls(shape, 1, n, 1, largest_divisor(n, side))

    @property
    def length(self) -> int:
        """L: entries per chunk."""
        return self.height * self.width

    @property
    def chunks(self) -> int:
        return (self.rows // self.height) * (self.cols // self.width)

    @property
    def index_bits(self) -> int:
        """w = max(1, ceil(log2 L)): the bits of an index within a chunk."""
        return max(1, (self.length - 1).bit_length())

    def chunk(self, x: tf.Tensor) -> tf.Tensor:
        """[chunks, L]: x's chunks, in order, each read row-major."""
        blocks = tf.reshape(x, [self.rows // self.height, self.height,
                                self.cols // self.width, self.width])
        return tf.reshape(tf.transpose(blocks, [0, 2, 1, 3]), [self.chunks, self.length])

    def unchunk(self, chunks: tf.Tensor) -> tf.Tensor:
        """The inverse of `chunk`: a tensor of `shape`."""
        blocks = tf.reshape(chunks, [self.rows // self.height, self.cols // self.width,
                                     self.height, self.width])
        return tf.reshape(tf.transpose(blocks, [0, 2, 1, 3]), self.shape)

    def places_rows(self, index: tf.Tensor) -> tf.Tensor:
        """[R, N, 2]: (chunk, place in chunk) of each of the R payloads' idx [R, chunks, k],
        for the scatters."""
        rows, k = index.shape[0], index.shape[2]
        chunk = tf.broadcast_to(tf.range(self.chunks, dtype=tf.int32)[None, :, None],
                                [rows, self.chunks, k])
        return tf.reshape(tf.stack([chunk, index], axis=-1), [rows, -1, 2])


def tree_sums(xs: list) -> list:
    """[r] per [r, n] x of `xs`: each row's sum S in a fixed order (module docstring), the rows of every x whose padded
    length is the same added as one batch (the same adds of the same values: the same bits),
    so a trace holds one halving chain per padded length, not one per row."""
    groups: dict[int, list[int]] = {}
    for j, x in enumerate(xs):
        n = x.shape[-1]
        groups.setdefault(1 << max(0, n - 1).bit_length(), []).append(j)
    out = [None] * len(xs)
    for size, members in groups.items():
        rows = []
        for j in members:
            x, n = xs[j], xs[j].shape[-1]
            rows.append(x if size == n else
                        tf.concat([x, tf.zeros([x.shape[0], size - n], x.dtype)], 1))
        x = rows[0] if len(rows) == 1 else tf.concat(rows, 0)
        while size > 1:  # (tf.split: the two halves in one op, where slicing takes two)
            size //= 2
            low, high = tf.split(x, 2, axis=1)
            x = low + high
        sums = tf.reshape(x, [-1])
        for j, part in zip(members, tf.split(sums, [xs[j].shape[0] for j in members])
                           if len(members) > 1 else [sums]):
            out[j] = part
    return out


@dataclasses.dataclass(frozen=True)
class ChunkedTopK:
    """C with `density`, `value_bits` (0: float32) and `sigmas` (module docstring)."""

    density: float
    value_bits: int
    sigmas: float

    def kept(self, geometry: Geometry) -> int:
        return kept(self.density, geometry.length)

    def encode_many(self, chunks: list, geometries: list) -> list[tuple]:
        """The wire parts of each tensor's chunks [chunks, L]: (packed idx, packed codes,
        book), or (packed idx, float32 values) with value_bits = 0; the quantisers' sums of
        every tensor batched (`quantise_many`)."""
        indices, values = [], []
        for each, geometry in zip(chunks, geometries):
            _, index = tf.math.top_k(tf.abs(each), self.kept(geometry))
            indices.append(bitpacking.pack_bit_fields(index, geometry.index_bits))
            values.append(tf.reshape(tf.gather(each, index, batch_dims=1), [-1]))
        if not self.value_bits:
            return list(zip(indices, values))
        return [(index, bitpacking.pack_levels(codes, self.value_bits), book)
                for index, (codes, book) in zip(indices, self.quantise_many(values))]

    def quantise_many(self, vals: list) -> list[tuple[tf.Tensor, tf.Tensor]]:
        """(q int32 [N], book float32 [B + 1]) of each tensor's kept values (module
        docstring), each with its own N, mu, sd and book; every sum S of a stage (the means,
        the deviations, the bins) in one `tree_sums`."""
        bins = 2 ** self.value_bits
        mus = [total[0] * F32(1.0 / val.shape[0])
               for val, total in zip(vals, tree_sums([val[None] for val in vals]))]
        cs = [val - mu for val, mu in zip(vals, mus)]
        spread = [j for j, val in enumerate(vals) if val.shape[0] > 1]
        squares = tree_sums([cs[j][None] * cs[j][None] for j in spread])
        sds = [tf.zeros([], tf.float32)] * len(vals)
        for j, total in zip(spread, squares):
            sds[j] = tf.sqrt(total[0]) * F32(1.0 / math.sqrt(vals[j].shape[0] - 1))
        qs, masks = [], []
        for c, sd in zip(cs, sds):
            s = sd * F32(self.sigmas / bins)
            s = tf.where((s > 0) & tf.math.is_finite(s), s, tf.ones_like(s))
            q = tf.cast(tf.clip_by_value(tf.round(c / s + F32(bins // 2)), 0.0,
                                         F32(bins - 1)), tf.int32)
            qs.append(q)
            masks.append(tf.equal(q[None, :], tf.range(bins, dtype=tf.int32)[:, None]))
        sums = tree_sums([tf.where(mask, c[None, :], tf.zeros_like(c)[None, :])
                          for mask, c in zip(masks, cs)])
        out = []
        for q, mask, mu, total in zip(qs, masks, mus, sums):
            counts = tf.reduce_sum(tf.cast(mask, tf.int32), axis=1)
            lookup = tf.math.divide_no_nan(total, tf.cast(counts, tf.float32))
            out.append((q, tf.concat([mu[None], lookup], 0)))
        return out

    def decode_rows(self, parts: tuple, geometry: Geometry) -> tuple[tf.Tensor, tf.Tensor]:
        """(idx int32 [R, chunks, k], C(val) float32 [R, N]) of R payloads' wire parts at
        once, each part with a leading axis of R."""
        k = self.kept(geometry)
        n = geometry.chunks * k
        rows = parts[0].shape[0]
        index = tf.reshape(bitpacking.unpack_bit_fields_rows(parts[0], n, geometry.index_bits),
                           [rows, geometry.chunks, k])
        if not self.value_bits:
            return index, parts[1]
        codes = bitpacking.unpack_levels_rows(parts[1], n, self.value_bits)
        book = parts[2]
        return index, tf.gather(book[:, 1:], codes, batch_dims=1) + book[:, :1]

    def wire_bytes(self, geometry: Geometry) -> int:
        """The bytes of one tensor's wire parts (module docstring)."""
        n = geometry.chunks * self.kept(geometry)
        index = bitpacking.packed_bytes(n, geometry.index_bits)
        if not self.value_bits:
            return index + 4 * n
        return (index + bitpacking.packed_bytes(n, self.value_bits)
                + 4 * (2 ** self.value_bits + 1))
