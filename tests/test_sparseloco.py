"""`sparseloco` (aggregation/local/sparseloco.py, chunked_topk.py): the chunks, k and index widths
by hand; the outer steps against a numpy model written op for op; the lossless setting
against `diloco:outer_momentum=0`; one sync's bytes against a hand count (the 2%, 2-bit
ratio); a run between 4 simulated nodes on the digits. Its identity options are checked
against one device by the contract test (tests/test_contract.py), its run between two
workers by tests/test_nodes_workers.py.
"""

import functools
import math

import numpy as np
import pytest
import tensorflow as tf

from mgloop import aggregation, data, models
from mgloop.aggregation.kernels import bitpacking
from mgloop.aggregation.kernels.chunked_topk import Geometry, kept, largest_divisor
from mgloop.errors import ConfigError
from tests import helpers
from tests.copies_by_hand import inner_steps_by_hand, method_on_copies

F32 = np.float32
U = 2.0 ** -24  # float32's unit roundoff


def test_chunks_by_hand():
    assert [largest_divisor(n, 64) for n in (192, 128, 100, 97, 10, 1)] == [64, 64, 50, 1, 10, 1]
    kernel = Geometry.of((192, 128), 64)  # 3 x 2 chunks of 64 x 64
    assert (kernel.chunks, kernel.length, kernel.index_bits) == (6, 4096, 12)
    assert (Geometry.of((128,), 64).chunks, Geometry.of((128,), 64).index_bits) == (2, 6)
    assert Geometry.of((10,), 64).length == 10 and Geometry.of((10,), 64).index_bits == 4
    conv = Geometry.of((3, 3, 4, 6), 8)  # a matrix [36, 6]: blocks 6 x 6
    assert (conv.rows, conv.cols, conv.height, conv.width) == (36, 6, 6, 6)
    assert Geometry.of((5,), 4).index_bits == 1  # chunks of one entry
    assert [kept(0.02, 4096), kept(0.015625, 4096), kept(0.02, 10), kept(1.0, 7)] == [82, 64, 1, 7]
    x = np.arange(24, dtype=F32).reshape(4, 6)  # blocks of 2 x 2, row-major, in block order
    chunks = Geometry.of((4, 6), 2).chunk(tf.constant(x)).numpy()
    assert chunks.tolist()[:4] == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11], [12, 13, 18, 19]]
    np.testing.assert_array_equal(Geometry.of((4, 6), 2).unchunk(chunks).numpy(), x)


def test_indices_travel_at_twelve_bits():
    """82 indices into a chunk of 4096 (`pack_bit_fields`, 12 bits): ceil(82 x 12 / 8) = 123
    bytes, index i's bit b at stream bit 12 i + b, little-endian in each byte (the bits laid
    out by hand with numpy); unpacked back exactly."""
    index = np.random.default_rng(4).choice(4096, 82, replace=False).astype(np.int32)
    packed = bitpacking.pack_bit_fields(tf.constant(index), 12).numpy()
    bits = ((index[:, None] >> np.arange(12)) & 1).astype(np.uint8).reshape(-1)
    np.testing.assert_array_equal(packed, np.packbits(bits, bitorder="little"))
    assert packed.dtype == np.uint8 and packed.size == 123
    np.testing.assert_array_equal(bitpacking.unpack_bit_fields(packed, 82, 12).numpy(), index)


def test_bad_options_are_refused_in_one_line():
    for spec, word in (("sparseloco:density=0", "density"), ("sparseloco:value_bits=9",
                                                             "value_bits"),
                       ("sparseloco:average=median", "average"), ("sparseloco:decay=1.5",
                                                                  "decay")):
        with pytest.raises(ConfigError) as error:
            aggregation.parse(spec)
        assert "\n" not in str(error.value) and word in str(error.value)


# ---- the numpy model ---------------------------------------------------------------------

def np_chunk(x, side):
    """[chunks, L] and the inverse, by hand: blocks h x w of the matrix [R, C] (vectors: runs)."""
    shape = x.shape
    rows, cols = (math.prod(shape[:-1]), shape[-1]) if len(shape) >= 2 else (1, x.size)
    h = max(d for d in range(1, side + 1) if rows % d == 0) if len(shape) >= 2 else 1
    w = max(d for d in range(1, side + 1) if cols % d == 0)
    blocks = x.reshape(rows // h, h, cols // w, w).transpose(0, 2, 1, 3)

    def back(chunks):
        return chunks.reshape(rows // h, cols // w, h, w).transpose(0, 2, 1, 3).reshape(shape)
    return blocks.reshape(-1, h * w), back


def np_tree_sum(x):
    size = 1 << max(0, len(x) - 1).bit_length()
    x = np.concatenate([x, np.zeros(size - len(x), F32)])
    while size > 1:
        size //= 2
        x = x[:size] + x[size:]
    return x[0]


def np_compress(chunks, density, bits, sigmas):
    """(idx [chunks, k], C(val) [chunks, k]): the k largest |e| per chunk (ties to the lower
    index), then the per-tensor codebook of 2^bits bins."""
    length = chunks.shape[1]
    k = min(length, max(1, round(density * length)))
    idx = np.argsort(-np.abs(chunks), axis=1, kind="stable")[:, :k]
    val = np.take_along_axis(chunks, idx, axis=1).reshape(-1)
    if bits == 0:
        return idx, val.reshape(idx.shape)
    n, bins = val.size, 2 ** bits
    mu = np_tree_sum(val) * F32(1.0 / n)
    c = val - mu
    sd = np.sqrt(np_tree_sum(c * c)) * F32(1.0 / math.sqrt(n - 1)) if n > 1 else F32(0)
    s = F32(sd) * F32(sigmas / bins)
    s = s if (s > 0 and np.isfinite(s)) else F32(1)
    q = np.clip(np.rint(c / s + F32(bins // 2)), 0, bins - 1).astype(int)
    book = np.array([np_tree_sum(np.where(q == j, c, F32(0))) / F32((q == j).sum())
                     if (q == j).any() else 0 for j in range(bins)], F32)
    return idx, (book[q] + mu).reshape(idx.shape)


class NumpySparseLoCo:
    """The method in numpy float32, op for op: T copies v[c][i], x[i] (the same on every
    copy) and e[c][i]."""

    def __init__(self, init, towers, side, density, bits, decay, lr, average="all"):
        self.v = [[w.copy() for w in init] for _ in range(towers)]
        self.x = [w.copy() for w in init]
        self.e = [[np.zeros_like(w) for w in init] for _ in range(towers)]
        self.towers, self.side, self.density, self.bits = towers, side, density, bits
        self.decay, self.lr, self.average = F32(decay), F32(lr), average

    def sync(self):
        for i in range(len(self.x)):
            sent = []
            for c in range(self.towers):
                chunks, back = np_chunk(self.decay * self.e[c][i] + (self.x[i] - self.v[c][i]),
                                        self.side)
                idx, values = np_compress(chunks, self.density, self.bits, 6.0)
                sent.append((idx, values))
                np.put_along_axis(chunks, idx, np.take_along_axis(chunks, idx, 1) - values, 1)
                self.e[c][i] = back(chunks)
            total, counts = np.zeros_like(chunks), np.zeros_like(chunks)
            for idx, values in sent:  # node order
                np.put_along_axis(total, idx, np.take_along_axis(total, idx, 1) + values, 1)
                np.put_along_axis(counts, idx, np.take_along_axis(counts, idx, 1) + F32(1), 1)
            mean = (total * F32(1.0 / self.towers) if self.average == "all" else
                    np.where(counts > 0, total / np.where(counts > 0, counts, F32(1)), F32(0)))
            self.x[i] = self.x[i] - self.lr * back(mean)
            for c in range(self.towers):
                self.v[c][i] = self.x[i].copy()


SHAPES = [(8, 6), (6,), (2, 3, 4), (5,)]  # chunk=4: 4 x 12, 2 x 3, 2 x 12, 5 x 1 entries
# one node's bytes by hand (`ChunkedTopK.wire_bytes`), density 0.25 (k = 3, 1, 3, 1):
# index bits 4, 2, 4, 1; then per bits: the codes' bytes and a book of 2^b + 1 float32s
HAND_BYTES = {0: (6 + 4 * 12) + (1 + 4 * 2) + (3 + 4 * 6) + (1 + 4 * 5),
              2: (6 + 3 + 20) + (1 + 1 + 20) + (3 + 2 + 20) + (1 + 2 + 20),
              3: (6 + 5 + 36) + (1 + 1 + 36) + (3 + 3 + 36) + (1 + 2 + 36)}


@pytest.mark.parametrize("towers, bits, average", [
    (2, 2, "all"), (4, 2, "contributors"), (2, 0, "all"), (3, 3, "all")])
def test_equals_numpy_model(towers, bits, average):
    """Hand-made inner progress (each copy's parameters moved by its own seeded noise each
    step), period 3, 10 steps (3 syncs): after every step every copy's parameters, x and e
    equal the numpy model's bit for bit (the same float32 element-wise ops; the sums in the
    quantiser in the same fixed order, the nodes' payloads added in node order). The traced
    sync sends (T - 1) P bytes per node, P counted by hand."""
    spec = (f"sparseloco:period=3,outer_lr=0.8,decay=0.9,density=0.25,chunk=4,"
            f"value_bits={bits},average={average}")
    rng = np.random.default_rng(5)
    init = [rng.standard_normal(shape).astype(F32) for shape in SHAPES]
    method, copies, after_update = method_on_copies(spec, towers, init)
    assert method.payload_bytes() == HAND_BYTES[bits]
    assert sum(method.traffic.sent.values()) == towers * (towers - 1) * HAND_BYTES[bits]
    model = NumpySparseLoCo(init, towers, 4, 0.25, bits, 0.9, 0.8, average)
    for s in range(10):
        inner_steps_by_hand(model.v, copies, rng, SHAPES)
        method.step_counter.assign(s)
        after_update()
        if (s + 1) % 3 == 0:
            model.sync()
        for c, copy in enumerate(copies):
            for i, variable in enumerate(copy.trainable):
                where = f"step {s} copy {c} variable {i}"
                np.testing.assert_array_equal(variable.numpy(), model.v[c][i], err_msg=where)
                np.testing.assert_array_equal(method._start[c][i].numpy(), model.x[i],
                                              err_msg=where)
                np.testing.assert_array_equal(method._error[c][i].numpy(), model.e[c][i],
                                              err_msg=where)
    assert any(np.abs(e).max() > 0.01 for e in model.e[0])  # the error feedback holds some
    assert np.abs(model.x[0] - init[0]).max() > 0.01  # the outer steps moved x


# ---- lossless: diloco without outer momentum ----------------------------------------------

LOSSLESS = "period=1,density=1,value_bits=0,decay=0"


def one_sync(spec, towers, init, moved):
    """x and every copy after one sync at step 0 from copies holding `moved`."""
    method, copies, after_update = method_on_copies(spec, towers, init)
    for copy, values in zip(copies, moved):
        for variable, value in zip(copy.trainable, values):
            variable.assign(value)
    after_update()
    return [[v.numpy() for v in copy.trainable] for copy in copies]


@pytest.mark.parametrize("towers", [2, 4])
def test_lossless_is_diloco_bit_for_bit_when_every_op_is_exact(towers):
    """Parameters on a grid of 2^-8 in [-4, 4] and alpha = 0.5: every subtraction, sum,
    1/T (T a power of two) and product is exact, so SparseLoCo's (1/T) sum_c (x - v_c) and
    DiLoCo's x - (1/T) sum_c v_c give the same bits."""
    rng = np.random.default_rng(2)
    grid = [(rng.integers(-1024, 1025, size=s) / 256.0).astype(F32) for s in SHAPES]
    moved = [[(w + rng.integers(-64, 65, size=w.shape) / 256.0).astype(F32) for w in grid]
             for _ in range(towers)]
    got = one_sync(f"sparseloco:{LOSSLESS},outer_lr=0.5,chunk=4", towers, grid, moved)
    want = one_sync("diloco:period=1,outer_momentum=0,outer_lr=0.5", towers, grid, moved)
    for a, b in zip(got, want):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    assert not np.array_equal(got[0][0], grid[0])


@pytest.mark.parametrize("towers", [2, 4])
def test_lossless_is_diloco_within_the_float32_bound(towers):
    """Any float32 inputs, alpha = 0.7: per element |x_SL - x_DL| <= u (alpha (T + 3)(D + V)
    + 2 |x'|) (sparseloco.py's bound, D = max_c |x - v_c|, V = max_c |v_c|, x' the new x;
    a few u more than the T u D and (T - 1) u V of the two sums, covering the
    roundings of x - a, alpha Delta and the last subtraction), 1.001 for second-order terms."""
    rng = np.random.default_rng(3)
    init = [rng.standard_normal(s).astype(F32) for s in SHAPES]
    moved = [[(w + F32(0.3) * rng.standard_normal(w.shape)).astype(F32) for w in init]
             for _ in range(towers)]
    got = one_sync(f"sparseloco:{LOSSLESS},outer_lr=0.7", towers, init, moved)
    want = one_sync("diloco:period=1,outer_momentum=0,outer_lr=0.7", towers, init, moved)
    for i, x in enumerate(init):
        d = np.max([np.abs(x.astype(np.float64) - m[i]) for m in moved], axis=0)
        v = np.max([np.abs(m[i].astype(np.float64)) for m in moved], axis=0)
        new = np.maximum(np.abs(got[0][i]), np.abs(want[0][i]))
        bound = U * (0.7 * (towers + 3) * (d + v) + 2 * new) * 1.001
        for c in range(towers):
            assert (np.abs(got[c][i].astype(np.float64) - want[c][i]) <= bound).all()


# ---- bytes: 2% density, 2-bit values -------------------------------------------------------

@pytest.mark.parametrize("towers", [2, 4])
def test_a_sync_at_two_percent_and_two_bits_against_diloco(towers):
    """A 128 x 128 kernel: 4 chunks of 64 x 64 = 4096, k = round(0.02 x 4096) = 82 each.
    One node's buffer: 328 indices at 12 bits (492 B), 328 codes at 2 bits (82 B), a book of
    5 float32s (20 B): P = 594 B, 0.29 bits per parameter. DiLoCo's ring sends
    2 (T-1)/T x 65536 B per node, the gather (T - 1) x 594 B: the ratio is
    (2/T) x 65536 / 594 = (2/T) x 110.33 (110.33 = 32 / (82/4096 x 14 + 160/16384))."""
    init = [np.random.default_rng(0).standard_normal((128, 128)).astype(F32)]
    sparse, _, _ = method_on_copies("sparseloco:period=1,density=0.02,value_bits=2", towers, init)
    dense, _, _ = method_on_copies("diloco:period=1", towers, init)
    assert sparse.payload_bytes() == 594
    per_node = {device: sent for device, sent in sparse.traffic.sent.items()}
    assert set(per_node.values()) == {(towers - 1) * 594}
    assert set(dense.traffic.sent.values()) == {2 * (towers - 1) * 65536 // towers}
    ratio = sum(dense.traffic.sent.values()) / sum(sparse.traffic.sent.values())
    assert ratio == pytest.approx(2 / towers * 65536 / 594, rel=1e-12)
    assert 65536 / 594 == pytest.approx(32 / (82 / 4096 * 14 + 160 / 16384), rel=1e-12)


# ---- training between 4 simulated nodes ----------------------------------------------------

def test_trains_between_four_simulated_nodes_on_the_digits(tmp_path):
    """The mlp on the 8x8 digits, 4 towers as 4 nodes, period 2, 6 steps (3 syncs): the
    weights move and stay finite, the 4 copies are equal after the last sync, and a sync's
    bytes between nodes are (T - 1) P = 3 P per node, P the sum of `wire_bytes`."""
    digits = data.load("digits", seed=0)
    config = helpers.small_config(str(tmp_path), aggregation="sparseloco:period=2,density=0.02",
                                  dataset="digits", devices="cpu:4", nodes=4,
                                  global_batch_size=32, optimizer="adam", learning_rate=0.01)
    model = functools.partial(models.get("mlp"), digits.input_shape, digits.num_classes)
    trainer = helpers.build_trainer(config, model, input_shape=digits.input_shape)
    start = helpers.copy_weights(trainer)[0]
    batches = [(x.numpy(), y.numpy()) for x, y in digits.train_batches(32, 1).take(6)]
    helpers.run_batches(trainer, batches)
    copies = helpers.copy_weights(trainer)
    assert all(np.isfinite(w).all() for weights in copies for w in weights)
    assert max(np.abs(w - w0).max() for w, w0 in zip(copies[0], start)) > 1e-2
    for other in copies[1:]:
        for a, b in zip(other, copies[0]):
            np.testing.assert_array_equal(a, b)
    sync = trainer.aggregation.traffic.of_occasion("sync").part("between", "gradient")
    assert set(sync.sent.values()) == {3 * trainer.aggregation.inner.payload_bytes()}
    assert len(sync.sent) == 4
