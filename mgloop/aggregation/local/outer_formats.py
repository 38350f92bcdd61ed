"""How `streaming_diloco` sends a fragment's outer gradients: uniform integers or E3M0 floats.

Copy c holds its outer gradient of the fragment F, delta_c = x_c - v_c (float32, one tensor
per variable of F, on its device). Both formats quantise it against one scale shared by
the copies and return, on every copy, the same bits of the mean (1/T) sum_c Q(delta_c):

    A = max_c max_{i in F} |delta_c,i|   (`shared_absmax`: each copy's absmax put in its
                                         slot of a length-T float32 vector, summed by the
                                         ring, ring.py: every copy gets all T exactly)

`int` (outer_bits = b in 2..8; `int_mean`): uniform symmetric levels, L = 2^(b-1) - 1
each side (b = 4: the integers -7..7), round to nearest (half to even),

    s = A * fl(1/L);  q_c = clip(round(delta_c / s), -L, L)  (0 where s = 0)
    mean = float32(sum_c q_c) * (s * fl(1/T))

|mean - (1/T) sum_c delta_c| <= s/2 = A/(2L) per element, up to float32's roundings. The
codes travel as the ring's partial sums in the narrowest signed integer type holding T L
(compression/scales.py's `sum_dtype`: int8 up to T L = 127), not packed at b bits: a
ring sums as it goes, and sums of T codes need more than b bits.

`e3m0` (`e3m0_mean`; the paper's 4-bit float, Douillard et al. 2025, arXiv 2501.18512:
a sign and 3 exponent bits, no mantissa). mgloop's exact definition (the paper does not
give its bias or its zero): the 3-bit field k in 0..7 codes the magnitude

    |Q(d)| = 0 (k = 0),   A 2^(k-7) (k = 1..7: A/64, A/32, ..., A/2, A)

and the sign bit the sign (set where d < 0). Rounding: to the nearest of these values in
linear distance, ties to the smaller magnitude, written as comparisons with the 7
midpoints (exact float32 constants times A, so every copy and numpy agree bit for bit):

    k = sum_j [ |d| > A c_j ],  c = (2^-7, 3 2^-7, 3 2^-6, 3 2^-5, 3 2^-4, 3 2^-3, 3 2^-2)

(A = 0 gives k = 0 everywhere; NaN, k = 0). Error, per element, for |d| <= A:

    |Q(d) - d| <= |d| / 3    where |d| >= A/64   (half the gap 2^(k-8) A at its widest,
                                                  the midpoint 3 2^(k-8) A)
    |Q(d) - d| <= A / 128    where |d| <  A/64

up to a relative 2^-24 of the rounded midpoints. The codes travel packed: the 4-bit field
(k in bits 0-2, the sign in bit 3) of every element of F, two per byte (bitpacking.py's
`pack_levels(., 4)`: element i in bits 4 (i mod 2) .. of byte floor(i/2)), ceil(n_F / 2)
bytes per copy, GATHERED (compression/transport.py's `ring_all_gather`; between worker
processes peers.py's one all-gather, padded to a multiple of 4 bytes): a sum of E3M0 values
is not an E3M0 value, so a ring could not add them on the way. Every copy decodes all T
payloads to the integers z = sign 2^(k-1) (0 for k = 0; |z| <= 64), adds them in int32
(exact, in any order) and forms

    mean = float32(sum_c z_c) * (A fl(2^-6) * fl(1/T))        (A 2^-6 exact)

so every copy has the same bits. Bytes per copy of one fragment's exchange: the scales'
ring, 2 (T-1) 4-byte chunks of the T-vector, and (T-1) ceil(n_F / 2) of codes, sent and
received; the float32 path's ring sends 2 (T-1)/T 4 n_F.
"""

from __future__ import annotations

import tensorflow as tf

from mgloop.aggregation.compression.scales import sum_dtype
from mgloop.aggregation.compression.transport import ring_all_gather
from mgloop.aggregation.kernels import bitpacking

FORMATS = ("int", "e3m0")
E3M0_MIDPOINTS = (2.0 ** -7,) + tuple(3 * 2.0 ** e for e in range(-7, -1))


def shared_absmax(method, deltas: list[list[tf.Tensor]]) -> list[tf.Tensor]:
    """A on every copy (module docstring): the copies' absmaxes through one ring."""
    num = method.num_towers
    first = getattr(method, "tower_offset", 0)  # this process's copy 0 among all T
    peaks = []
    for device, mine in zip(method.devices.towers, deltas):
        with tf.device(device):
            peak = tf.reduce_max(tf.stack([tf.reduce_max(tf.abs(d)) for d in mine]))
            peaks.append([tf.tensor_scatter_nd_update(tf.zeros([num]), [[first + len(peaks)]],
                                                        [peak])])
    gathered = method.ring_mean(peaks, average=False)  # every copy's absmax, exactly
    out = []
    for device, (vector,) in zip(method.devices.towers, gathered):
        with tf.device(device):
            out.append(tf.reduce_max(vector))
    return out


def int_mean(method, deltas: list[list[tf.Tensor]], bits: int) -> list[list[tf.Tensor]]:
    """(1/T) sum_c Q(delta_c), Q uniform with L = 2^(bits-1) - 1 levels each side (top)."""
    num, levels = method.num_towers, 2 ** (bits - 1) - 1
    peaks = shared_absmax(method, deltas)
    codes_dtype = sum_dtype(num, levels)
    codes, scales = [], []
    for device, mine, peak in zip(method.devices.towers, deltas, peaks):
        with tf.device(device):
            scale = peak * (1.0 / levels)
            scales.append(scale)
            codes.append([tf.cast(tf.clip_by_value(
                tf.round(tf.math.divide_no_nan(d, scale)), -levels, levels), codes_dtype)
                for d in mine])
    totals = method.ring_mean(codes, average=False)  # integer sums: exact, any order
    out = []
    for device, sums, scale in zip(method.devices.towers, totals, scales):
        with tf.device(device):
            out.append([tf.cast(total, tf.float32) * (scale * (1.0 / num)) for total in sums])
    return out


def e3m0_codes(d: tf.Tensor, peak: tf.Tensor) -> tf.Tensor:
    """The 4-bit fields (int32, k + 8 sign) of d against the scale A = `peak` (top)."""
    magnitude = tf.abs(d)
    k = tf.add_n([tf.cast(magnitude > peak * c, tf.int32) for c in E3M0_MIDPOINTS])
    return k + 8 * tf.cast(d < 0, tf.int32)


def e3m0_integers(fields: tf.Tensor) -> tf.Tensor:
    """z = sign 2^(k-1) (0 for k = 0) of 4-bit fields, int32."""
    k = tf.bitwise.bitwise_and(fields, 7)
    magnitude = tf.where(k > 0, tf.bitwise.left_shift(tf.ones_like(k), tf.maximum(k - 1, 0)),
                         tf.zeros_like(k))
    return magnitude * (1 - 2 * tf.bitwise.right_shift(fields, 3))


def e3m0_mean(method, deltas: list[list[tf.Tensor]]) -> list[list[tf.Tensor]]:
    """(1/T) sum_c Q(delta_c), Q the E3M0 format (top), the packed codes gathered."""
    towers = list(method.devices.towers)
    peaks = shared_absmax(method, deltas)
    shapes = [d.shape for d in deltas[0]]
    sizes = [shape.num_elements() for shape in shapes]
    payloads = []
    for device, mine, peak in zip(towers, deltas, peaks):
        with tf.device(device):
            flat = tf.concat([tf.reshape(d, [-1]) for d in mine], 0)
            payloads.append((bitpacking.pack_levels(e3m0_codes(flat, peak), 4),))
    have = ring_all_gather(method, payloads, towers)
    out = []
    for device, received, peak in zip(towers, have, peaks):
        with tf.device(device):
            total = tf.add_n([e3m0_integers(bitpacking.unpack_levels(packed, sum(sizes), 4))
                              for (packed,) in received])
            mean = tf.cast(total, tf.float32) * (peak * 2.0 ** -6 * (1.0 / method.num_towers))
            out.append([tf.reshape(part, shape)
                        for part, shape in zip(tf.split(mean, sizes), shapes)])
    return out
