"""DeMo (mgloop/aggregation/compression/demo.py, dct.py) against a numpy model of itself.

- the chunked DCT-II against the explicit cosine sum, and the chunk sizes against the
  reference code's rule (the largest divisor up to the target);
- the method, op for op, against a float64 numpy model on hand-made gradients over
  three steps (momentum, top-k per chunk, the removal of what was sent, the gathered
  mean over senders or nodes, the IDCT, the sign), replicas bit-identical;
- the lossless setting (topk = the whole chunk, decay=0, sign=false) is the exact mean,
  on one device and on 4, within dct.round_trip_bound;
- the exact bytes of one step against a hand count; the 12-bit index fields;
- training at --nodes=4 (mlp on digits) moves the weights and stays finite;
- the refusals.

Tolerance between the float32 method and the float64 model (same selections: the tests
assert a margin between the k-th and the (k+1)-th coefficient, and between Q and 0 where
signs are compared): each step transforms every chunk forward and back, each within
dct.round_trip_bound rho of the exact, relative to the norms it transforms (at most S,
the largest norm of any tower's x = beta m + g in the model); a top-k selection is
non-expansive, so after s steps the momentum is within s rho S and Q within (s + 1) rho S;
doubled for the second-order terms the bound neglects.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from mgloop import aggregation, data, models
from mgloop.aggregation.compression import dct
from mgloop.aggregation.kernels import bitpacking
from mgloop.cluster import devices
from mgloop.errors import ConfigError
from mgloop.runs.config import Config
from tests import helpers
from tests.test_compression import exchange

SHAPES = [(8, 12), (10,), (2, 3, 4), ()]
# The model's selections and signs are kept this far (relative to S) from a tie or from
# 0: more than twice the tolerance below, so float32 makes the same choices.
MARGIN = 1e-4
MLP_SHAPES = [(64, 128), (128,), (128, 10), (10,)]


# ---- the numpy model -------------------------------------------------------------------

def cosine_basis(n):
    """D[k, i] = a_k cos(pi (2i + 1) k / 2n), written out term by term."""
    out = np.zeros((n, n))
    for k in range(n):
        a = math.sqrt((1.0 if k == 0 else 2.0) / n)
        for i in range(n):
            out[k, i] = a * math.cos(math.pi * (2 * i + 1) * k / (2 * n))
    return out


def chunking(shape, target):
    rows, cols = (1, 1) if not shape else (1, shape[0]) if len(shape) == 1 else (
        math.prod(shape[:-1]), shape[-1])
    largest = [max(d for d in range(1, n + 1) if n % d == 0 and d <= target)
               for n in (rows, cols)]
    return rows, cols, *largest


def encode(x, target):
    rows, cols, r, c = chunking(x.shape, target)
    blocks = np.reshape(x.astype(np.float64), (rows // r, r, cols // c, c))
    y = np.einsum("bh,yhxw,dw->yxbd", cosine_basis(r), blocks, cosine_basis(c))
    return np.reshape(y, (-1, r * c))


def decode(y, shape, target):
    rows, cols, r, c = chunking(shape, target)
    blocks = np.reshape(y, (rows // r, cols // c, r, c))
    x = np.einsum("bh,yxbd,dw->yhxw", cosine_basis(r), blocks, cosine_basis(c))
    return np.reshape(x, shape)


class DemoModel:
    """DeMo in float64, per tower and variable, as demo.py's docstring states it."""

    def __init__(self, shapes, towers, decay, topk, chunk, sign, mean):
        self.shapes, self.towers = shapes, towers
        self.decay, self.topk, self.chunk, self.sign, self.mean = decay, topk, chunk, sign, mean
        self.momentum = [[np.zeros(s) for s in shapes] for _ in range(towers)]
        self.largest = [0.0] * len(shapes)  # S: the largest ||x|| per variable

    def step(self, values):
        out = []
        for i, shape in enumerate(self.shapes):
            totals, counts = None, None
            for t in range(self.towers):
                x = self.decay * self.momentum[t][i] + values[t][i]
                self.largest[i] = max(self.largest[i], np.linalg.norm(x))
                y = encode(x, self.chunk)
                k = min(self.topk, y.shape[1])
                order = np.argsort(-np.abs(y), axis=1, kind="stable")
                if k < y.shape[1]:  # the selection must not hang on a rounding
                    gap = (np.abs(np.take_along_axis(y, order[:, k - 1:k], 1))
                           - np.abs(np.take_along_axis(y, order[:, k:k + 1], 1)))
                    assert gap.min() > MARGIN * self.largest[i], "hand-made input near a tie"
                chosen = np.zeros_like(y, dtype=bool)
                np.put_along_axis(chosen, order[:, :k], True, 1)
                sent = np.where(chosen, y, 0.0)
                self.momentum[t][i] = x - decode(sent, shape, self.chunk)
                totals = sent if totals is None else totals + sent
                counts = chosen * 1.0 if counts is None else counts + chosen
            if self.mean == "senders":
                mean = np.where(counts > 0, totals / np.maximum(counts, 1), 0.0)
            else:
                mean = totals / self.towers
            out.append(decode(mean, shape, self.chunk))
        return out


def make(spec, towers, shapes):
    method = aggregation.make(spec, devices.setup(devices.parse(f"cpu:{towers}")))
    variables = [tf.Variable(tf.zeros(s)) for s in shapes]
    method.build(variables)
    return method, variables


def gradients(towers, shapes, seed):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(towers)]


# ---- the transform ---------------------------------------------------------------------

def test_chunk_sizes_are_the_largest_divisors_up_to_the_target():
    assert [dct.split(n, 64) for n in (64, 128, 10, 100, 784, 1)] == [64, 64, 10, 50, 56, 1]
    assert [dct.split(n, 4) for n in (7, 12, 6)] == [1, 4, 3]
    assert dct.Chunking.of((3, 3, 8, 16), 64) == dct.Chunking(72, 16, 36, 16)
    assert dct.Chunking.of((128,), 64) == dct.Chunking(1, 128, 1, 64)
    assert dct.Chunking.of((), 64) == dct.Chunking(1, 1, 1, 1)


@pytest.mark.parametrize("shape, target", [((6, 8), 4), ((12,), 5), ((2, 3, 4), 3), ((7,), 7)])
def test_the_dct_is_the_cosine_sum_per_chunk(shape, target):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32)
    rows, cols, r, c = chunking(shape, target)
    blocks = np.reshape(x.astype(np.float64), (rows // r, r, cols // c, c))
    expected = []  # chunk by chunk, row-major; coefficient (k1, k2) at k1 c + k2
    for y in range(rows // r):
        for xc in range(cols // c):
            chunk = blocks[y, :, xc, :]
            coefficients = np.zeros((r, c))
            for k1 in range(r):
                for k2 in range(c):
                    a = math.sqrt((1 if k1 == 0 else 2) / r) * math.sqrt((1 if k2 == 0 else 2) / c)
                    coefficients[k1, k2] = a * sum(
                        chunk[i, j] * math.cos(math.pi * (2 * i + 1) * k1 / (2 * r))
                        * math.cos(math.pi * (2 * j + 1) * k2 / (2 * c))
                        for i in range(r) for j in range(c))
            expected.append(coefficients.ravel())
    expected = np.array(expected)
    got = dct.Chunking.of(shape, target)
    coefficients = got.encode(tf.reshape(tf.constant(x), [-1])).numpy()
    bound = dct.round_trip_bound(got, 1) * np.linalg.norm(x)  # one way is within half of it
    assert np.abs(coefficients - expected).max() <= bound
    back = got.decode(tf.constant(coefficients)).numpy()
    assert np.linalg.norm(back - x.ravel()) <= bound
    np.testing.assert_allclose(dct.basis(5), cosine_basis(5), rtol=0, atol=1e-15)


# ---- the method against the model ------------------------------------------------------

@pytest.mark.parametrize("sign, mean, seed", [(False, "senders", 4), (False, "nodes", 4),
                                              (True, "senders", 5)])
def test_demo_matches_its_numpy_model(sign, mean, seed):
    towers, decay, topk, chunk, steps = 3, 0.5, 3, 4, 3
    spec = f"demo:decay={decay},topk={topk},chunk={chunk},sign={str(sign).lower()},mean={mean}"
    method, variables = make(spec, towers, SHAPES)
    model = DemoModel(SHAPES, towers, decay, topk, chunk, sign, mean)
    for step in range(steps):
        values = gradients(towers, SHAPES, seed * 10 + step)
        out = exchange(method, variables, values, compiled=True)
        expected = model.step(values)
        for copy in out[1:]:  # replicas bit-identical
            for a, b in zip(copy, out[0]):
                np.testing.assert_array_equal(a, b)
        for i, shape in enumerate(SHAPES):
            rho = dct.round_trip_bound(dct.Chunking.of(shape, chunk), towers)
            tol = 2 * (step + 2) * rho * model.largest[i]
            assert 2 * tol < MARGIN * model.largest[i]
            if sign:
                q = expected[i]
                assert np.abs(q).min() > MARGIN * model.largest[i], "a Q entry near 0"
                np.testing.assert_array_equal(out[0][i], np.sign(q))
            else:
                assert np.abs(out[0][i] - expected[i]).max() <= tol, (step, i)
            for t in range(towers):
                kept = method.extra[t][i]["momentum"].numpy()
                assert np.abs(kept - model.momentum[t][i]).max() <= tol, (step, i, t)
    assert int(method.steps[0].numpy()) == steps


@pytest.mark.parametrize("towers, mean", [(1, "senders"), (4, "senders"), (4, "nodes")])
def test_lossless_setting_is_the_exact_mean(towers, mean):
    """topk = chunk^2, decay=0, sign=false: every coefficient of every tower's g travels,
    so out = IDCT(mean_t DCT(g_t)): the mean, within dct.round_trip_bound * max_t ||g_t||
    (at T = 1: one device's own gradient)."""
    method, variables = make(f"demo:topk=4096,decay=0,sign=false,mean={mean}", towers,
                             MLP_SHAPES)
    for step in range(2):  # decay=0: nothing carried into the second step
        values = gradients(towers, MLP_SHAPES, 20 + step)
        out = exchange(method, variables, values, compiled=True)
        for i, shape in enumerate(MLP_SHAPES):
            exact = np.mean([values[t][i] for t in range(towers)], axis=0, dtype=np.float64)
            largest = max(np.linalg.norm(values[t][i]) for t in range(towers))
            rho = dct.round_trip_bound(dct.Chunking.of(shape, 64), towers)
            for copy in out:
                assert np.linalg.norm(copy[i] - exact) <= rho * largest, (step, i)


# ---- bytes -----------------------------------------------------------------------------

@pytest.mark.parametrize("transport_dtype, value_bytes", [("float32", 4), ("bfloat16", 2)])
def test_bytes_of_one_step_are_the_hand_count(transport_dtype, value_bytes):
    """The MLP's tensors at chunk=64, topk=32, 4 towers (each sends its payload to the 3
    others around the ring, and receives theirs):
      (64, 128):  2 chunks of 64 x 64 = 4096: 64 values, 64 indices at 12 bits = 96 B
      (128,):     2 chunks of 1 x 64: 64 values, 64 indices at 6 bits = 48 B
      (128, 10):  2 chunks of 64 x 10 = 640: 64 values, 64 indices at 10 bits = 80 B
      (10,):      1 chunk of 10 <= topk: all 10 coefficients in order, no indices."""
    method = aggregation.make("demo", devices.setup(devices.parse("cpu:4")), transport_dtype)
    variables = [tf.Variable(tf.zeros(s)) for s in MLP_SHAPES]
    method.build(variables)
    exchange(method, variables, gradients(4, MLP_SHAPES, 3), compiled=False)
    payload = (64 * value_bytes + 96) + (64 * value_bytes + 48) + (64 * value_bytes + 80) \
        + 10 * value_bytes
    assert method.traffic.as_dict() == {f"CPU:{t}": {"sent": 3 * payload, "received": 3 * payload}
                                        for t in range(4)}


def test_indices_travel_in_12_bit_fields():
    index = tf.constant([0, 4095, 17, 2048, 1], tf.int32)
    packed = bitpacking.pack_bit_fields(index, bitpacking.index_bits(4096))
    assert packed.dtype == tf.uint8 and packed.shape == [8]  # ceil(5 * 12 / 8)
    np.testing.assert_array_equal(bitpacking.unpack_bit_fields(packed, 5, 12), index)
    assert [bitpacking.index_bits(n) for n in (1, 2, 10, 64, 640, 4096)] == [0, 1, 4, 6, 10, 12]


# ---- training and refusals -------------------------------------------------------------

def test_training_at_four_nodes_moves_and_stays_finite(tmp_path):
    config = Config(aggregation="demo", devices="cpu:4", nodes=4, model="mlp",
                    dataset="digits", optimizer="sgd", learning_rate=0.01,
                    global_batch_size=32, train_steps=3, steps_per_loop=3, seed=3,
                    deterministic=True, logdir=str(tmp_path), summary_every=0, log_every=0,
                    diagnostics=False)
    settings = config.validated()
    dataset = data.load("digits", 3, None, None)
    stream = data.epochs.step_batches(dataset, 32, 1, 3, 0, settings.drop_remainder).take(3)
    trainer = helpers.build_trainer(
        config, lambda: models.get("mlp")(dataset.input_shape, dataset.num_classes),
        input_shape=dataset.input_shape)
    start = helpers.copy_weights(trainer)
    loss_sum = helpers.run_batches(trainer, [(x.numpy(), y.numpy()) for x, y in stream])
    after = helpers.copy_weights(trainer)
    assert math.isfinite(loss_sum)
    for copy, begin in zip(after, start):
        for w, w0 in zip(copy, begin):
            assert np.isfinite(w).all()
            # sign steps: an entry moves by lr or 0 per step (plus the subtraction's rounding)
            moved = np.abs(w - w0).max()
            assert 0 < moved <= 3 * 0.01 + 3 * 2.0 ** -24 * (np.abs(w0).max() + 0.03)
    for copy in after[1:]:
        for a, b in zip(copy, after[0]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("settings, words", [
    (dict(aggregation="demo:topk=17,chunk=4"), "topk=17 exceeds the 16 coefficients"),
    (dict(aggregation="demo", optimizer="adam"), "applies momentum itself"),
    (dict(aggregation="demo:decay=1"), "decay"),
    (dict(aggregation="demo:mean=all"), "mean"),
    (dict(aggregation="demo:chunk=0"), "chunk")])
def test_refusals_are_one_line(settings, words):
    with pytest.raises(ConfigError) as error:
        Config(devices="cpu:2", **settings).validated()
    assert "\n" not in str(error.value) and words in str(error.value)
