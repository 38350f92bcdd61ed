"""Bit-packing of compressed payloads into the uint8 tensors that would travel between machines.

Every packer here writes a field of w bits per element (x flattened, n elements) into one
stream of n w bits, then cuts the stream into bytes:

    stream bit k = bit (k mod w) of field floor(k / w)      (a field's least significant bit first)
    byte j       = sum_{b=0..7} 2^b stream bit (8 j + b)    (little-endian bit order in a byte)

so element i's field starts at stream bit i w, and the last byte is padded with zero bits.
The packed tensor is 1-D uint8 of exactly `packed_bytes(n, w)` = ceil(n w / 8) bytes. With
w = 1 this is np.packbits(bits, bitorder="little"). The fields, per payload:

    signs           w = 1       bit = 1 if x_i >= 0 (zero and -0.0 pack as +1), else 0 (NaN: -1)
    ternary         w = 2       t_i in {-1, 0, +1} as 2-bit two's complement: 0 -> 00,
                                +1 -> 01, -1 -> 11 (10 is never written)
    levels          w = bits    an integer in [0, 2^bits), bits in 1..8
    unsigned        w = bits    an integer in [0, 2^bits), bits in 1..31 (e.g. an index within
                                a chunk of at most 2^bits entries: 12 bits for 4096)
    signed levels   w = bits+1  |q_i| < 2^bits in the low `bits` bits, the sign (1 if q_i < 0)
                                in the top bit; QSGD with s levels (|l_i| <= s) needs
                                bits = level_bits(s) = ceil(log2(s + 1)), so it sends
                                ceil(log2(s + 1)) + 1 bits per element
    indices         the narrowest integer type that holds 0..n-1 (`index_dtype`): uint8 up
                    to n = 2^8, uint16 up to 2^16, int32 up to 2^31, int64 beyond; no bit
                    fields (whole bytes per index)
    bit fields      w = bits (1..31) per non-negative integer below 2^w (`pack_bit_fields`;
                    DeMo's indices within a chunk of E coefficients at index_bits(E) =
                    ceil(log2 E) bits: 12 for 64 x 64)

Values out of a field's range are not checked: only their low w bits are kept. Everything is
TensorFlow ops (tf.bitwise shifts and masks, and a weighted sum of disjoint bits), works
inside `tf.function` on CPU, and accepts tensors of any shape (flattened) whose size need
not be known when traced; the unpackers take the element count n (a Python int, or a
scalar int32 tensor inside `tf.function`; `unpack_indices` takes a Python int).
"""

from __future__ import annotations

import tensorflow as tf

_BYTE_WEIGHTS = [1 << b for b in range(8)]  # bit b of a byte, little-endian


def packed_bytes(n: int, bits: int) -> int:
    """The exact byte size ceil(n bits / 8) of n elements packed at `bits` bits each."""
    return (n * bits + 7) // 8


def level_bits(levels: int) -> int:
    """The magnitude bits ceil(log2(levels + 1)) that hold the levels 0..levels (levels >= 1)."""
    if levels < 1:
        raise ValueError(f"levels must be >= 1, got {levels}")
    return int(levels).bit_length()


def _check_bits(bits: int, low: int, high: int) -> None:
    if not low <= bits <= high:
        raise ValueError(f"bits must be in {low}..{high}, got {bits}")


def _pack_fields(fields: tf.Tensor, width: int) -> tf.Tensor:
    """1-D uint8: the low `width` bits of each int32 of `fields` (flattened), laid out as above."""
    fields = tf.reshape(tf.cast(fields, tf.int32), [-1])
    shifts = tf.constant(list(range(width)), tf.int32)
    bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(tf.expand_dims(fields, 1), shifts), 1)
    stream = tf.reshape(tf.cast(bits, tf.uint8), [-1])  # element i's bit b at i width + b
    n = fields.shape[0]
    if n is None:  # a size unknown when traced: the padding computed when run
        stream = tf.pad(stream, [[0, tf.math.floormod(-tf.size(stream), 8)]])
    elif n * width % 8:
        stream = tf.pad(stream, [[0, -n * width % 8]])
    by_byte = tf.reshape(stream, [-1, 8])
    return tf.reduce_sum(by_byte * tf.constant(_BYTE_WEIGHTS, tf.uint8), axis=1)


def _unpack_fields(packed: tf.Tensor, n: int, width: int) -> tf.Tensor:
    """[n] int32 in [0, 2^width): the inverse of `_pack_fields` for its first n fields."""
    packed = tf.reshape(tf.convert_to_tensor(packed, tf.uint8), [-1])
    return _unpack_field_rows(tf.expand_dims(packed, 0), n, width)[0]


def _unpack_field_rows(packed: tf.Tensor, n: int, width: int) -> tf.Tensor:
    """[R, n] int32: `_unpack_fields` of each row of the [R, bytes] packed (each row packed
    by itself), as one batched computation."""
    packed = tf.convert_to_tensor(packed, tf.uint8)
    rows = packed.shape[0]
    shifts = tf.constant(list(range(8)), tf.uint8)
    bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(tf.expand_dims(packed, 2), shifts), 1)
    stream = tf.reshape(bits, [rows, -1])
    if not isinstance(n, int) or stream.shape[1] != n * width:  # the last byte's padding
        stream = stream[:, :n * width]
    by_field = tf.cast(tf.reshape(stream, [rows, n, width]), tf.int32)
    return tf.reduce_sum(by_field * tf.constant([1 << b for b in range(width)], tf.int32),
                         axis=2)


def pack_signs(x: tf.Tensor) -> tf.Tensor:
    """1 bit per element: 1 where x >= 0 (zero packs as +1), 0 elsewhere (NaN too).

    TensorFlow's CPU kernels may flush subnormals to zero: a negative subnormal may pack as +1."""
    return _pack_fields(tf.cast(tf.reshape(x, [-1]) >= 0, tf.int32), 1)


def unpack_signs(packed: tf.Tensor, n: int, dtype: tf.DType = tf.float32) -> tf.Tensor:
    """[n] of +1 / -1 in `dtype`: the signs `pack_signs` wrote (never 0)."""
    return tf.cast(2 * _unpack_fields(packed, n, 1) - 1, dtype)


def unpack_signs_rows(packed: tf.Tensor, n: int, dtype: tf.DType = tf.float32) -> tf.Tensor:
    """[R, n]: `unpack_signs` of each row of [R, bytes] (R payloads at once)."""
    return tf.cast(2 * _unpack_field_rows(packed, n, 1) - 1, dtype)


def _check_size(t: tf.Tensor, n: int | None) -> None:
    size = t.shape.num_elements()
    if n is not None and size is not None and size != n:
        raise ValueError(f"{size} elements given with n = {n}")


def pack_ternary(t: tf.Tensor, n: int | None = None) -> tf.Tensor:
    """2 bits per element (4 per byte) for values in {-1, 0, +1}, any integer or float dtype.

    The field is the value mod 4 (2-bit two's complement); `n`, if given, must be t's size."""
    t = tf.reshape(t, [-1])
    _check_size(t, n)
    return _pack_fields(tf.math.floormod(tf.cast(t, tf.int32), 4), 2)


def unpack_ternary(packed: tf.Tensor, n: int, dtype: tf.DType = tf.float32) -> tf.Tensor:
    """[n] of -1, 0, +1 in `dtype`: the values `pack_ternary` wrote."""
    return _ternary(_unpack_fields(packed, n, 2), dtype)


def unpack_ternary_rows(packed: tf.Tensor, n: int, dtype: tf.DType = tf.float32) -> tf.Tensor:
    """[R, n]: `unpack_ternary` of each row of [R, bytes] (R payloads at once)."""
    return _ternary(_unpack_field_rows(packed, n, 2), dtype)


def _ternary(fields: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    return tf.cast(fields - 4 * tf.cast(fields >= 2, tf.int32), dtype)


def pack_levels(q: tf.Tensor, bits: int) -> tf.Tensor:
    """`bits` bits per element (1..8) for non-negative integer levels in [0, 2^bits)."""
    _check_bits(bits, 1, 8)
    return _pack_fields(tf.reshape(q, [-1]), bits)


def unpack_levels(packed: tf.Tensor, n: int, bits: int,
                  dtype: tf.DType = tf.int32) -> tf.Tensor:
    """[n] levels in [0, 2^bits) in `dtype`: the inverse of `pack_levels`."""
    _check_bits(bits, 1, 8)
    return tf.cast(_unpack_fields(packed, n, bits), dtype)


def pack_signed_levels(q: tf.Tensor, bits: int) -> tf.Tensor:
    """bits + 1 bits per element for signed integers |q| < 2^bits (bits in 1..8): the
    magnitude in the low `bits` bits, the sign (1 if q < 0) in the top bit."""
    _check_bits(bits, 1, 8)
    q = tf.reshape(tf.cast(q, tf.int32), [-1])
    negative = tf.cast(q < 0, tf.int32)
    return _pack_fields(tf.abs(q) + tf.bitwise.left_shift(negative, bits), bits + 1)


def unpack_signed_levels(packed: tf.Tensor, n: int, bits: int,
                         dtype: tf.DType = tf.int32) -> tf.Tensor:
    """[n] signed integers in `dtype`: the inverse of `pack_signed_levels`."""
    _check_bits(bits, 1, 8)
    return _signed(_unpack_fields(packed, n, bits + 1), bits, dtype)


def unpack_signed_levels_rows(packed: tf.Tensor, n: int, bits: int,
                              dtype: tf.DType = tf.int32) -> tf.Tensor:
    """[R, n]: `unpack_signed_levels` of each row of [R, bytes] (R payloads at once)."""
    _check_bits(bits, 1, 8)
    return _signed(_unpack_field_rows(packed, n, bits + 1), bits, dtype)


def _signed(fields: tf.Tensor, bits: int, dtype: tf.DType) -> tf.Tensor:
    magnitude = tf.bitwise.bitwise_and(fields, (1 << bits) - 1)
    negative = tf.bitwise.right_shift(fields, bits)
    return tf.cast(magnitude * (1 - 2 * negative), dtype)


def index_bits(n: int) -> int:
    """The fewest bits ceil(log2 n) that hold the indices 0..n-1 (0 for n = 1: nothing to
    send)."""
    return (int(n) - 1).bit_length()


def pack_bit_fields(values: tf.Tensor, bits: int) -> tf.Tensor:
    """`bits` bits per element (1..31) for non-negative integers below 2^bits, e.g. indices
    into 2^bits entries: ceil(n bits / 8) bytes."""
    _check_bits(bits, 1, 31)
    return _pack_fields(tf.reshape(values, [-1]), bits)


def unpack_bit_fields(packed: tf.Tensor, n: int, bits: int) -> tf.Tensor:
    """[n] int32: the inverse of `pack_bit_fields`."""
    _check_bits(bits, 1, 31)
    return _unpack_fields(packed, n, bits)


def unpack_bit_fields_rows(packed: tf.Tensor, n: int, bits: int) -> tf.Tensor:
    """[R, n] int32: `unpack_bit_fields` of each row of [R, bytes] (R payloads at once)."""
    _check_bits(bits, 1, 31)
    return _unpack_field_rows(packed, n, bits)


def unpack_levels_rows(packed: tf.Tensor, n: int, bits: int) -> tf.Tensor:
    """[R, n] int32: `unpack_levels` of each row of [R, bytes] (R payloads at once)."""
    _check_bits(bits, 1, 8)
    return _unpack_field_rows(packed, n, bits)


def index_dtype(n: int) -> tf.DType:
    """The narrowest integer dtype that holds the indices 0..n-1: uint8 for n <= 2^8, uint16
    for n <= 2^16, int32 for n <= 2^31, int64 beyond."""
    if n <= 1 << 8:
        return tf.uint8
    if n <= 1 << 16:
        return tf.uint16
    if n <= 1 << 31:
        return tf.int32
    return tf.int64


def pack_indices(idx: tf.Tensor, n: int) -> tf.Tensor:
    """`idx` (indices into n elements, unchecked) cast to `index_dtype(n)`; shape kept."""
    return tf.cast(idx, index_dtype(n))


def unpack_indices(packed: tf.Tensor, n: int) -> tf.Tensor:
    """The indices as int32 (int64 when n > 2^31), the dtypes tf.gather and scatters take."""
    return tf.cast(packed, tf.int64 if n > 1 << 31 else tf.int32)


def to_bytes(parts) -> tf.Tensor:
    """The bytes of `parts` (tensors of any numeric dtype), concatenated in order: one
    uint8 vector, what a bucket of payloads sends as one message (`from_bytes` inverts it
    exactly: tf.bitcast keeps every bit)."""
    pieces = [tf.reshape(p if p.dtype == tf.uint8 else tf.bitcast(p, tf.uint8), [-1])
              for p in parts]
    return pieces[0] if len(pieces) == 1 else tf.concat(pieces, 0)


def from_bytes(raw: tf.Tensor, likes) -> tuple:
    """The tensors shaped and typed as `likes` whose bytes `to_bytes` put in `raw`, in order."""
    return tuple(tf.reshape(rows, like.shape)
                 for rows, like in zip(from_bytes_rows(tf.expand_dims(raw, 0), likes), likes))


def from_bytes_rows(raw: tf.Tensor, likes) -> tuple:
    """`from_bytes` of each row of the [R, bytes] raw (R messages of one layout) at once:
    per like, an [R, *like.shape] tensor."""
    rows, out = raw.shape[0], []
    sizes = [like.shape.num_elements() * like.dtype.size for like in likes]
    # one split of the rows, not a slice per like (a slice is four ops in the trace); the
    # last part (-1) holds what follows the likes, e.g. a gather's padding, or nothing
    pieces = tf.split(raw, sizes + [-1], axis=1)
    for like, piece in zip(likes, pieces):
        if like.dtype == tf.uint8:
            flat = piece
        elif like.dtype.size == 1:
            flat = tf.bitcast(piece, like.dtype)
        else:
            flat = tf.bitcast(tf.reshape(piece, [rows, -1, like.dtype.size]), like.dtype)
        out.append(tf.reshape(flat, [rows, *like.shape]))
    return tuple(out)
