"""mgloop/aggregation/kernels/bitpacking.py against small numpy models of itself.

The models write every field bit by bit (stream bit i w + b is bit b of element i's field,
byte k // 8 holds stream bit k at bit k % 8), and the signs also against np.packbits with
bitorder="little". On hand-made inputs (the bytes worked out by hand from the documented
layout) and on random inputs of awkward lengths: the packed bytes equal the model's, the
unpackers invert the model's bytes, exact round trips, uint8 of exactly `packed_bytes`
bytes, and the same bytes from inside a `tf.function` traced for any length.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from mgloop.aggregation.kernels import bitpacking as bp
LENGTHS = [1, 7, 8, 9, 1000, 1023]
BITS = list(range(1, 9))


# The numpy models.

def np_pack_fields(fields, width):
    out = np.zeros((len(fields) * width + 7) // 8, np.uint8)
    for i, value in enumerate(int(v) for v in fields):
        for b in range(width):
            k = i * width + b
            out[k // 8] |= ((value >> b) & 1) << (k % 8)
    return out


def np_unpack_fields(packed, n, width):
    packed = np.asarray(packed)
    return np.array([sum(((int(packed[(i * width + b) // 8]) >> ((i * width + b) % 8)) & 1) << b
                         for b in range(width)) for i in range(n)], np.int64)


def np_ternary_fields(t):
    return np.array([{0: 0, 1: 1, -1: 3}[int(v)] for v in t], np.int64)


def np_signed_fields(q, bits):
    return np.array([abs(int(v)) | (int(v < 0) << bits) for v in q], np.int64)


def np_unsigned_fields_to_signed(fields, bits):
    return np.array([(f & ((1 << bits) - 1)) * (-1 if f >> bits else 1) for f in fields])


def np_index_dtype(n):
    for dtype in (np.uint8, np.uint16, np.int32, np.int64):
        if np.iinfo(dtype).max >= n - 1:
            return dtype


def random_floats(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.random(n) < 0.1] = 0.0
    return x


def check_packed(packed, n, bits, expected):
    assert packed.dtype == tf.uint8
    assert packed.shape == (bp.packed_bytes(n, bits),)
    assert packed.shape == expected.shape
    np.testing.assert_array_equal(packed.numpy(), expected)


# The layout, by hand.

def test_hand_made_bytes():
    x = tf.constant([1.0, -2.0, 0.0, -0.0, 3.0, -1.0, -1.0, -1.0, 5.0])
    np.testing.assert_array_equal(bp.pack_signs(x), [0b00011101, 0b1])
    np.testing.assert_array_equal(bp.unpack_signs(bp.pack_signs(x), 9),
                                  [1, -1, 1, 1, 1, -1, -1, -1, 1])
    t = tf.constant([1, -1, 0, 1, -1])  # fields 01 11 00 01 | 11
    np.testing.assert_array_equal(bp.pack_ternary(t, 5), [1 + (3 << 2) + (1 << 6), 3])
    q = tf.constant([5, 2, 7])  # 5 + 2 << 3 + 7 << 6 = 469 = 256 + 213
    np.testing.assert_array_equal(bp.pack_levels(q, 3), [213, 1])
    s = tf.constant([-3, 1, 0, -1])  # fields 111 001 000 101: 7 + 8 + (5 << 9) = 2575
    np.testing.assert_array_equal(bp.pack_signed_levels(s, 2), [2575 % 256, 2575 // 256])
    np.testing.assert_array_equal(bp.unpack_signed_levels(bp.pack_signed_levels(s, 2), 4, 2),
                                  [-3, 1, 0, -1])


def test_sign_conventions():
    x = tf.constant([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -1e-30])
    np.testing.assert_array_equal(bp.unpack_signs(bp.pack_signs(x), 7),
                                  [1, 1, 1, -1, -1, 1, -1])


# Against the models, random inputs of awkward lengths.

@pytest.mark.parametrize("n", LENGTHS)
def test_signs(n):
    x = random_floats(n, n)
    packed = bp.pack_signs(tf.constant(x))
    reference = np.packbits(x >= 0, bitorder="little")
    check_packed(packed, n, 1, reference)
    np.testing.assert_array_equal(packed.numpy(), np_pack_fields(x >= 0, 1))
    signs = bp.unpack_signs(tf.constant(reference), n)
    assert signs.dtype == tf.float32 and signs.shape == (n,)
    np.testing.assert_array_equal(signs.numpy(), np.where(x >= 0, 1.0, -1.0))
    np.testing.assert_array_equal(bp.unpack_signs(packed, n, tf.int8).numpy(),
                                  np.where(x >= 0, 1, -1))


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", [tf.int8, tf.int32, tf.float32])
def test_ternary(n, dtype):
    t = np.random.default_rng(n).integers(-1, 2, n)
    packed = bp.pack_ternary(tf.constant(t, dtype), n)
    reference = np_pack_fields(np_ternary_fields(t), 2)
    check_packed(packed, n, 2, reference)
    out = bp.unpack_ternary(tf.constant(reference), n)
    assert out.dtype == tf.float32 and out.shape == (n,)
    np.testing.assert_array_equal(out.numpy(), t)
    np.testing.assert_array_equal(bp.unpack_ternary(packed, n, dtype).numpy(), t)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("bits", BITS)
def test_levels(n, bits):
    q = np.random.default_rng(100 * n + bits).integers(0, 1 << bits, n)
    q[: min(n, 2)] = [(1 << bits) - 1, 0][: min(n, 2)]  # the extremes
    packed = bp.pack_levels(tf.constant(q, tf.int32), bits)
    reference = np_pack_fields(q, bits)
    check_packed(packed, n, bits, reference)
    np.testing.assert_array_equal(np_unpack_fields(reference, n, bits), q)  # the model itself
    out = bp.unpack_levels(tf.constant(reference), n, bits)
    assert out.dtype == tf.int32 and out.shape == (n,)
    np.testing.assert_array_equal(out.numpy(), q)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("bits", BITS)
def test_signed_levels(n, bits):
    top = (1 << bits) - 1
    q = np.random.default_rng(100 * n + bits).integers(-top, top + 1, n)
    q[: min(n, 3)] = [top, -top, 0][: min(n, 3)]
    packed = bp.pack_signed_levels(tf.constant(q, tf.int32), bits)
    reference = np_pack_fields(np_signed_fields(q, bits), bits + 1)
    check_packed(packed, n, bits + 1, reference)
    np.testing.assert_array_equal(
        np_unsigned_fields_to_signed(np_unpack_fields(reference, n, bits + 1), bits), q)
    out = bp.unpack_signed_levels(tf.constant(reference), n, bits)
    assert out.dtype == tf.int32 and out.shape == (n,)
    np.testing.assert_array_equal(out.numpy(), q)


@pytest.mark.parametrize("n", [7, 1000])
def test_rows_unpack_each_row_as_one_payload(n):
    """The batched unpackers ([R, bytes] -> [R, n]) equal the single one on each row."""
    rng = np.random.default_rng(n)
    signs = rng.integers(0, 2, (3, n))
    ternary = rng.integers(-1, 2, (3, n))
    signed = rng.integers(-7, 8, (3, n))
    cases = [
        (bp.unpack_signs_rows, bp.unpack_signs, [bp.pack_signs(2 * r - 1) for r in signs], ()),
        (bp.unpack_ternary_rows, bp.unpack_ternary, [bp.pack_ternary(r) for r in ternary], ()),
        (bp.unpack_signed_levels_rows, bp.unpack_signed_levels,
         [bp.pack_signed_levels(r, 3) for r in signed], (3,)),
        (bp.unpack_levels_rows, bp.unpack_levels, [bp.pack_levels(r + 7, 4) for r in signed],
         (4,))]
    for rows, single, packed, bits in cases:
        out = rows(tf.stack(packed), n, *bits)
        assert out.shape == (3, n), single.__name__
        for r, one in enumerate(packed):
            np.testing.assert_array_equal(out[r].numpy(), single(one, n, *bits).numpy())


def test_packed_bytes_and_level_bits():
    for n in LENGTHS + [0]:
        for bits in range(1, 10):
            assert bp.packed_bytes(n, bits) == math.ceil(n * bits / 8)
    for levels in range(1, 1025):
        assert bp.level_bits(levels) == math.ceil(math.log2(levels + 1))
    with pytest.raises(ValueError):
        bp.level_bits(0)
    for bad in (0, 9):
        with pytest.raises(ValueError):
            bp.pack_levels(tf.constant([0]), bad)
        with pytest.raises(ValueError):
            bp.unpack_signed_levels(tf.zeros([1], tf.uint8), 1, bad)
    with pytest.raises(ValueError):
        bp.pack_ternary(tf.constant([1, 0]), 3)


def test_shapes_are_flattened():
    q = np.random.default_rng(0).integers(0, 8, (3, 5))
    np.testing.assert_array_equal(bp.pack_levels(tf.constant(q), 3).numpy(),
                                  np_pack_fields(q.reshape(-1), 3))


# Indices.

@pytest.mark.parametrize("n", [1, 2, 255, 256, 257, 65535, 65536, 65537, 2 ** 31 - 1, 2 ** 31,
                               2 ** 31 + 1, 2 ** 40])
def test_index_dtype(n):
    assert bp.index_dtype(n).as_numpy_dtype == np_index_dtype(n)


@pytest.mark.parametrize("n", LENGTHS + [256, 257, 70000, 2 ** 31 + 5])
def test_indices(n):
    idx = np.random.default_rng(n % 1000).integers(0, n, 50)
    idx[:2] = [0, n - 1]
    packed = bp.pack_indices(tf.constant(idx, tf.int64), n)
    assert packed.dtype == bp.index_dtype(n)
    assert packed.shape == (50,)
    np.testing.assert_array_equal(packed.numpy(), idx.astype(np_index_dtype(n)))
    out = bp.unpack_indices(packed, n)
    assert out.dtype == (tf.int64 if n > 2 ** 31 else tf.int32)
    np.testing.assert_array_equal(out.numpy(), idx)


# Inside tf.function: one trace for every length.

def test_inside_tf_function():
    floats, ints = tf.TensorSpec([None], tf.float32), tf.TensorSpec([None], tf.int32)

    @tf.function(input_signature=[floats, floats, ints, ints], autograph=False)
    def round_trips(x, t, q, s):
        with tf.device("/CPU:0"):
            n = tf.size(x)
            packed = (bp.pack_signs(x), bp.pack_ternary(t), bp.pack_levels(q, 5),
                      bp.pack_signed_levels(s, 4))
            return packed, (bp.unpack_signs(packed[0], n), bp.unpack_ternary(packed[1], n),
                            bp.unpack_levels(packed[2], n, 5),
                            bp.unpack_signed_levels(packed[3], n, 4))

    for n in LENGTHS:
        rng = np.random.default_rng(n)
        inputs = (np.where(random_floats(n, n) >= 0, 1.0, -1.0).astype(np.float32),
                  rng.integers(-1, 2, n).astype(np.float32),
                  rng.integers(0, 32, n).astype(np.int32),
                  rng.integers(-15, 16, n).astype(np.int32))
        references = (np.packbits(inputs[0] >= 0, bitorder="little"),
                      np_pack_fields(np_ternary_fields(inputs[1]), 2),
                      np_pack_fields(inputs[2], 5),
                      np_pack_fields(np_signed_fields(inputs[3], 4), 5))
        packed, outs = round_trips(*(tf.constant(x) for x in inputs))
        for width, p, reference, x, out in zip((1, 2, 5, 5), packed, references, inputs, outs):
            check_packed(p, n, width, reference)
            np.testing.assert_array_equal(out.numpy(), x)
    assert round_trips.experimental_get_tracing_count() == 1


# Bucketing: the bytes of several tensors as one uint8 message, and back.

def test_to_bytes_is_numpys_bytes_and_from_bytes_inverts_it_exactly():
    rng = np.random.default_rng(5)
    parts = [rng.standard_normal(7).astype(np.float32), rng.integers(0, 256, 5, np.uint8),
             rng.integers(-128, 128, (2, 3), np.int8), rng.integers(-2**15, 2**15, 3, np.int16),
             rng.integers(-2**31, 2**31, 4, np.int64).astype(np.int32),
             np.array([np.nan, -0.0, np.inf], np.float32)]
    raw = bp.to_bytes([tf.constant(p) for p in parts]).numpy()
    assert raw.dtype == np.uint8
    assert raw.tobytes() == b"".join(p.tobytes() for p in parts)  # little-endian, in order
    back = tf.function(lambda r: bp.from_bytes(r, [tf.constant(p) for p in parts]))(raw)
    for got, part in zip(back, parts):
        assert got.dtype == part.dtype and got.shape == part.shape
        assert got.numpy().tobytes() == part.tobytes()  # every bit, NaN and -0 included


@pytest.mark.parametrize("sizes, limit, expected", [
    ([10, 10, 10], 0, [[0], [1], [2]]),           # 0: every tensor alone
    ([10, 10, 10], 20, [[0, 1], [2]]),            # fill up to the limit, in order
    ([10, 30, 5, 5], 20, [[0], [1], [2, 3]]),     # one above the limit goes alone
    ([10, 10, 10], 10**6, [[0, 1, 2]]),
    ([], 20, [])])
def test_buckets_are_consecutive_and_within_the_limit(sizes, limit, expected):
    from mgloop.aggregation.compression.transport import buckets_of
    assert buckets_of(sizes, limit) == expected
