"""The quantisers and PowerSGD (aggregation/compression/{qsgd,signs,onebit,powersgd}.py)
against their numpy models (tests/quantiser_models.py), for single exchanges on hand-made
tower values on 4 towers; unbiasedness over many seeds; the error-feedback identity;
PowerSGD at full rank against one device on 2 and 4 towers; bad options refused.
(The contract test runs each with its defaults, including the resume of the residuals and
of PowerSGD's Q bit-identically under --deterministic.)

Tolerances, u = 2^-24 and gamma(k) = k u / (1 - k u) (tests/tolerance.py):
- integer levels and signs, and what the replicas hold against each other: exact;
- a float32 value decoded from its payload against the float64 model: gamma(T + 8) of
  the magnitudes it is formed from (a norm or 1-norm of n terms adds gamma(n));
- PowerSGD against its float64 model: the Householder QR's backward error (Higham,
  Accuracy and Stability, Thm 19.4, gamma~(k) = 2 k u taken for its gamma~(c k)) on the n x r
  P and the m x r Q, times the condition number of P (how far a perturbation of P turns
  its column space), and the products' gamma(n + m + T).
"""

import math
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from mgloop import aggregation, settings
from mgloop.aggregation import checks as exchange_checks
from mgloop.aggregation.compression import powersgd, qsgd, transport
from mgloop.aggregation.dense import ring
from mgloop.aggregation.kernels import bitpacking
from mgloop.cluster import devices
from mgloop.errors import ConfigError
from tests import helpers, tolerance
from tests import quantiser_models as model

U = tolerance.U
TOWERS = 4
# Hand-made tower values of three variables: a 6 x 5 matrix, a vector and a 3 x 2 x 4 kernel.
# The vector's columns: three zeros and one +; ties of two + against two -; majorities.
VECTORS = np.array([[0.0, 1.0, 1.0, -2.0, 0.5],
                    [0.0, -1.0, 2.0, -0.25, 0.5],
                    [3.0, 1.0, -0.5, -1.0, -0.5],
                    [0.0, -2.0, 4.0, 1.0, -0.125]], np.float32)
SHAPES = [(6, 5), (5,), (3, 2, 4)]


def tower_values(scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    matrices = [rng.standard_normal((6, 5)).astype(np.float32) * scale for _ in range(TOWERS)]
    kernels = [rng.standard_normal((3, 2, 4)).astype(np.float32) * scale for _ in range(TOWERS)]
    return [[matrices[t], VECTORS[t] * np.float32(scale), kernels[t]] for t in range(TOWERS)]


@pytest.fixture(scope="module")
def device_set():
    return devices.setup(devices.parse(f"cpu:{TOWERS}"))


@pytest.fixture(scope="module")
def variables(device_set):
    with tf.device(device_set.towers[0]):
        return [tf.Variable(tf.zeros(shape), trainable=True) for shape in SHAPES]


def make(spec, device_set, variables):
    method = aggregation.make(spec, device_set)
    method.build(variables)
    return method


def place(method, values):
    placed = []
    for device, per_tower in zip(method.devices.towers, values):
        with tf.device(device):
            placed.append([tf.constant(v) for v in per_tower])
    return placed


def exchange(method, values, variables):
    """One reduce: out[c][v] as numpy, asserting the replicas hold bit-identical values."""
    out = [[v.numpy() for v in per_copy] for per_copy in
           method.reduce(place(method, values), variables, average=True)]
    for per_copy in out[1:]:
        for a, b in zip(per_copy, out[0]):
            np.testing.assert_array_equal(a, b)
    return out[0]


def assert_close(actual, expected, bound):
    """|actual - expected| <= bound elementwise (bound: an array or a number)."""
    gap = np.abs(np.asarray(actual, np.float64) - expected)
    assert np.all(gap <= bound), f"off by {gap.max():.3g}, bound {np.min(bound):.3g}"


def residuals(method):
    return [[r.numpy() for r in per_tower] for per_tower in method.residuals]


def ring_bytes(n: int, itemsize: int) -> int:
    """Bytes all towers send together in one ring all-reduce of n elements: every chunk
    travels T-1 times in each half."""
    return 2 * (TOWERS - 1) * sum(ring.chunk_sizes(n, TOWERS)) * itemsize


def summable_bytes(ring_parts, wire_bytes: int) -> int:
    """All towers' bytes of one variable's summable exchange: the packed payload gathered
    when that moves fewer bytes (compression/base.py), else each part (n, itemsize) in the
    ring."""
    payload = sum(n * size for n, size in ring_parts)
    if wire_bytes < payload and TOWERS * wire_bytes < 2 * payload:
        return TOWERS * (TOWERS - 1) * wire_bytes
    return sum(ring_bytes(n, size) for n, size in ring_parts)


def total_sent(method) -> int:
    return sum(method.traffic.sent.values())


# ---- QSGD and TernGrad -------------------------------------------------------------------

@pytest.mark.parametrize("levels", [1, 3])
def test_stochastic_levels_match_the_model(levels):
    x = np.array([0.0, 0.1, -0.5, 1.0, -1.0, 0.3333, 0.9999, -0.25], np.float32)
    uniform = np.array([0.5, 0.05, 0.99, 0.0, 0.3, 0.7, 0.999, 0.5], np.float32)
    scale = np.float32(1.0)
    expected = model.stochastic_levels(x, scale, levels, uniform)
    got = qsgd.stochastic_levels(tf.constant(x), tf.constant(scale), levels,
                                 tf.constant(uniform)).numpy()
    np.testing.assert_array_equal(got, expected)
    assert np.abs(got).max() <= levels and np.all(got[x == 0] == 0)


@pytest.mark.parametrize("spec,levels,bucket", [("qsgd:levels=2", 2, 512),
                                                 ("qsgd:levels=3,bucket=4", 3, 4),
                                                 ("terngrad", 1, 0),
                                                 ("terngrad:clip=0", 1, 0)])
def test_one_exchange_matches_the_model(spec, levels, bucket, device_set, variables):
    method = make(spec, device_set, variables)
    values = tower_values()
    # the seeds of step 0, as the exchange draws them (a site makes its seeds when first
    # read: read them before the exchange counts its step)
    seeds = [[method.site(t, i, tf.constant(values[t][i])).tower_seed
              for i in range(len(SHAPES))] for t in range(TOWERS)]
    out = exchange(method, values, variables)
    norm = np.inf if spec.startswith("terngrad") else 2
    for i in range(len(SHAPES)):
        xs = [values[t][i].ravel() for t in range(TOWERS)]
        uniform = [tf.random.stateless_uniform([xs[t].size], seeds[t][i]).numpy()
                   for t in range(TOWERS)]
        expected, _, ls, scale = model.shared_scale_quantiser(
            xs, levels, uniform, norm, bucket, clip=2.5 if spec == "terngrad" else 0.0)
        # the decoded mean is the integer sum on the shared scales: recover and compare levels
        recovered = out[i].ravel() * TOWERS * levels / scale
        assert_close(recovered, np.sum(ls, axis=0),
                     tolerance.gamma(TOWERS + 8 + xs[0].size) * TOWERS * levels)
        assert_close(out[i].ravel(), expected, tolerance.gamma(TOWERS + 8) * np.abs(expected))
    # bytes: the levels packed at ceil(log2(s + 1)) + 1 bits and gathered (or int8 levels
    # on the ring, if fewer), one float32 per bucket, tower and variable gathered
    buckets = [-(-math.prod(s) // (bucket or math.prod(s))) for s in SHAPES]
    assert buckets == ([1, 1, 1] if bucket != 4 else [8, 2, 6])
    bits = bitpacking.level_bits(levels) + 1
    expected_bytes = sum(summable_bytes([(math.prod(s), 1)],
                                        bitpacking.packed_bytes(math.prod(s), bits))
                         + TOWERS * (TOWERS - 1) * 4 * b for s, b in zip(SHAPES, buckets))
    assert total_sent(method) == expected_bytes
    again = exchange(method, values, variables)  # the next step draws anew: other levels
    assert any(np.any(a != b) for a, b in zip(again, out))


@pytest.mark.parametrize("spec", ["qsgd", "terngrad", "signsgd", "signsgd:bits=1",
                                  "efsignsgd", "onebit", "demo:chunk=4,topk=3",
                                  "demo:chunk=2,topk=4", "topk:ratio=0.5"])
def test_a_receiver_unpacks_every_wire_at_once_as_one_by_one(spec, device_set, variables):
    """`unpack_rows` of the T wires a tower receives (stacked part by part) holds, row by
    row, the bits `unpack` makes of each wire alone, and `decompress_rows` of those the bits
    `decompress` makes of each payload (its own: of what it sent): a gather's receiver
    unpacks and decompresses them as one batch."""
    method = make(spec, device_set, variables)
    for i, site_values in enumerate(zip(*place(method, tower_values()))):
        encoded = method.encode([[v] * len(SHAPES) for v in site_values], i)
        site = encoded.sites[0]
        rows = method.unpack_rows(transport.stacked(encoded.wires), site)
        decompressed = method.decompress_rows(rows, site)
        for t, wire in enumerate(encoded.wires):
            payload = method.unpack(wire, site)
            for got, expected in zip(rows, payload):
                np.testing.assert_array_equal(got[t].numpy(), expected.numpy(), err_msg=spec)
            for expected in (method.decompress(payload, site), encoded.sent[t]):
                np.testing.assert_array_equal(decompressed[t].numpy(), expected.numpy(),
                                              err_msg=spec)


def test_terngrad_clips_at_c_standard_deviations():
    x = np.array([10.0, 0.5, -0.5, 0.25, -1.0, 0.0, 0.75, -0.25], np.float32)  # one outlier
    limit = 2.5 * x.astype(np.float64).std()
    got = qsgd.clipped(tf.constant(x), 2.5).numpy()
    assert_close(got, np.clip(x, -limit, limit), tolerance.gamma(2 * x.size + 4) * limit)
    assert got[0] < 9 and np.array_equal(got[1:], x[1:])  # only the outlier moved


@pytest.mark.parametrize("levels", [1, 2])
def test_levels_are_unbiased(levels):
    """The mean of N independent draws of the decoded levels (M / s) l lies
    within the Hoeffding bound of x: each draw is within one level M / s of its mean, so
    P(|mean_N - x_i| >= eps) <= 2 exp(-2 N eps^2 s^2 / M^2); eps for a chance of 1e-9 per
    entry. A biased rounding (floor, or to nearest) is off by up to M / (2 s) on these x."""
    x = np.array([0.0, 0.1, -0.25, 0.5, -0.7, 0.95, 1.0, -0.3333], np.float32)
    scale, draws = np.float32(1.0), 4000
    uniform = tf.random.stateless_uniform([draws, x.size], [0, 7])  # N independent rows
    levels_drawn = qsgd.stochastic_levels(tf.constant(np.tile(x, (draws, 1))),
                                          tf.constant(scale), levels, uniform).numpy()
    decoded = levels_drawn.astype(np.float64) * scale / levels
    eps = scale / levels * math.sqrt(math.log(2e9) / (2 * draws))
    assert np.abs(decoded.mean(axis=0) - x).max() <= eps
    on_grid = np.floor(np.abs(x) * levels / scale)  # each draw is one of two adjacent levels
    assert np.all((np.abs(levels_drawn) == on_grid) | (np.abs(levels_drawn) == on_grid + 1))
    nearest = np.sign(x) * np.round(np.abs(x) * levels / scale) * scale / levels
    assert np.abs(nearest - x).max() > 2 * eps  # what a biased rounding would miss by


# ---- signs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["signsgd", "signsgd:scaled=false"])
def test_majority_vote(spec, device_set, variables):
    method = make(spec, device_set, variables)
    values = tower_values()
    out = exchange(method, values, variables)
    scaled = spec == "signsgd"
    for i in range(len(SHAPES)):
        xs = [values[t][i] for t in range(TOWERS)]
        expected, _, votes = model.majority_vote(xs, scaled)
        np.testing.assert_array_equal(np.sign(out[i]), votes)  # the vote, exactly
        if scaled:
            np.testing.assert_allclose(out[i], expected,
                                       rtol=tolerance.gamma(TOWERS + 8 + xs[0].size))
        else:
            np.testing.assert_array_equal(out[i], votes)
    # the hand-made vector: three zeros and a + vote +; ties (2 against 2) vote 0
    np.testing.assert_array_equal(np.sign(out[1]), [1, 0, 1, -1, 0])
    # the votes at 2 bits (ternary: sign(0) = 0) gathered, or int8 on the ring if fewer bytes
    expected_bytes = sum(summable_bytes([(math.prod(s), 1)] + ([(1, 4)] if scaled else []),
                                        bitpacking.packed_bytes(math.prod(s), 2)
                                        + (4 if scaled else 0)) for s in SHAPES)
    assert total_sent(method) == expected_bytes


@pytest.mark.parametrize("spec,reference,extra,bits", [("efsignsgd", model.scaled_sign, 4, 2),
                                                       ("onebit", model.onebit, 8, 1)])
def test_gathered_signs_match_the_model(spec, reference, extra, bits, device_set, variables):
    method = make(spec, device_set, variables)
    values = tower_values()
    out = exchange(method, values, variables)
    after = residuals(method)
    for i in range(len(SHAPES)):
        xs = [values[t][i] for t in range(TOWERS)]
        expected, sent = reference(xs)
        magnitude = np.mean([np.abs(x) for x in xs], axis=0) + np.abs(expected)
        assert_close(out[i], expected, tolerance.gamma(TOWERS + 8 + xs[0].size) * magnitude)
        for t in range(TOWERS):  # memory=residual: e_t = x_t - c_t
            assert_close(after[t][i], xs[t] - sent[t],
                         tolerance.gamma(8 + xs[0].size) * np.abs(xs[t]).max())
    # bytes: each tower's signs (2 bits each, ternary; onebit's bits 1 each) and its
    # float32 scale(s), to T-1 towers
    assert total_sent(method) == sum(
        TOWERS * (TOWERS - 1) * (bitpacking.packed_bytes(math.prod(s), bits) + extra)
        for s in SHAPES)


# ---- error feedback ------------------------------------------------------------------------

@pytest.mark.parametrize("spec,rank", [("efsignsgd", 1), ("onebit", 1),
                                       ("qsgd:levels=4,bucket=8,memory=residual", 1),
                                       ("terngrad:memory=residual", 1),
                                       ("powersgd:rank=1,min_compression=0", 1)])
def test_error_feedback_identity(spec, rank, device_set, variables):
    """What the replicas apply plus the new residuals is the gradients plus the old
    residuals: out + (1/T) sum_t e_t(new) = (1/T) sum_t (g_t + e_t(old)), up to the
    roundings of x_t = g_t + e_t, c_t (a product of r terms), e_t = x_t - c_t and the mean
    of T: gamma(T + r + 4) sqrt(r) (1/T) sum_t (||x_t|| + ||e_t||) in the 2-norm (for
    PowerSGD ||P^ Q_t^T|| <= ||Q_t|| <= ||x_t||, P^ orthonormal)."""
    method = make(spec, device_set, variables)
    exchange(method, tower_values(seed=2), variables)  # a first step: residuals not zero
    old = residuals(method)
    values = tower_values(seed=3)
    out = exchange(method, values, variables)
    new = residuals(method)
    for i in range(len(SHAPES)):
        xs = [values[t][i].astype(np.float64) + old[t][i] for t in range(TOWERS)]
        gap = out[i] + np.mean([new[t][i] for t in range(TOWERS)], axis=0) - np.mean(xs, 0)
        bound = tolerance.gamma(TOWERS + rank + 4) * math.sqrt(rank) * np.mean(
            [np.linalg.norm(xs[t]) + np.linalg.norm(new[t][i]) for t in range(TOWERS)])
        assert np.linalg.norm(gap) <= bound, (spec, i, np.linalg.norm(gap), bound)
    # lossy indeed: the residuals moved (their identity is not 0 = 0)
    assert any(np.abs(new[t][0]).max() > 1e-3 for t in range(TOWERS))


# ---- PowerSGD ------------------------------------------------------------------------------

def test_orthonormal_basis_of_a_rank_deficient_matrix():
    a = np.array([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 1.0, 1.0], [1.0, 0.0, 1.0]],
                 np.float32)  # column 3 = column 1 + column 2: rank 2
    basis = powersgd.orthonormal(tf.constant(a)).numpy().astype(np.float64)
    bound = 2 * 2 * a.size * U  # Householder: orthonormal to gamma~(n m)
    np.testing.assert_allclose(basis.T @ basis, np.eye(3), rtol=0, atol=bound * 3)
    np.testing.assert_allclose(basis @ basis.T @ a, a, rtol=0,
                               atol=bound * 3 * np.abs(a).max())
    np.testing.assert_allclose(np.abs(basis.T @ model.orthonormal(a)[:, :2])[:2],
                               np.eye(2)[:2], atol=bound * 3)  # the same first two directions


def powersgd_bound(ms, q, p_hat):
    """Normwise: QR backward errors of P (n x r) and of Q (m x r) times cond(P), and the
    products' roundings, relative to (1/T) sum_t ||M_t||."""
    n, m = ms[0].shape
    r = q.shape[1]
    p = np.mean([mt @ model.orthonormal(q) for mt in ms], axis=0)
    singular = np.linalg.svd(p, compute_uv=False)
    condition = singular[0] / singular[r - 1]
    relative = (2 * 2 * (n * r + m * r) * U * condition + tolerance.gamma(n + m + TOWERS))
    return relative * np.mean([np.linalg.norm(mt) for mt in ms])


def column_signs_free(a, b):
    """max over columns of min(||a_j - b_j||, ||a_j + b_j||)."""
    return max(min(np.linalg.norm(a[:, j] - b[:, j]), np.linalg.norm(a[:, j] + b[:, j]))
               for j in range(a.shape[1]))


def test_powersgd_one_exchange_matches_the_model(device_set, variables):
    method = make("powersgd:rank=2,min_compression=0", device_set, variables)
    assert [p is not None for p in method.plans] == [True, False, True]  # the vector: whole
    for step, seed in enumerate((4, 5)):  # the first Q from the seed, then the warm start
        values = tower_values(seed=seed)
        old = residuals(method)
        qs = [method.extra[0][i]["q"].numpy() for i in (0, 2)]
        out = exchange(method, values, variables)
        for k, i in enumerate((0, 2)):
            n, m = model.matrix_shape(SHAPES[i])
            ms = [(values[t][i] + old[t][i]).reshape(n, m) for t in range(TOWERS)]
            expected, sent, p_hat, q_new = model.powersgd(ms, qs[k])
            bound = powersgd_bound(ms, qs[k], p_hat)
            assert np.linalg.norm(out[i].reshape(n, m) - expected) <= bound
            kept = [method.extra[t][i]["q"].numpy() for t in range(TOWERS)]
            for q in kept[1:]:
                np.testing.assert_array_equal(q, kept[0])  # Q: the same on every tower
            assert column_signs_free(kept[0], q_new) <= bound
            after = residuals(method)
            for t in range(TOWERS):
                assert np.linalg.norm(after[t][i].reshape(n, m) - (ms[t] - sent[t])) <= (
                    bound * TOWERS)
        np.testing.assert_allclose(out[1], np.mean([values[t][1] for t in range(TOWERS)], 0),
                                   rtol=0, atol=tolerance.gamma(TOWERS + 1) * 4)
    # bytes of the two exchanges: ring 1 carries the P's (n r) and the vector, ring 2 the Q's
    assert total_sent(method) == 2 * (ring_bytes(6 * 2 + 5 + 6 * 2, 4)
                                      + ring_bytes(5 * 2 + 4 * 2, 4))


class FullRankBound(tolerance.StepBound):
    """The reference's StepBound with, on every compressed matrix v (n x m, full rank
    r = min(n, m), memory=none), the exchange's own error added to the gradient's before the
    update map carries it: ||out - mean|| <= eps_v (1/T) sum_t ||M_t|| with eps_v =
    2 2 (n r + m r) u + gamma(n + m + T) (powersgd_bound with cond(orth(Q)) = 1 for P's
    column space: P^ spans the mean M's columns), each shard's ||M_t|| <= T ||A|| (A the
    mean |per-example gradient| over the global batch, which StepBound holds as dg / 2 gamma)."""

    def __init__(self, towers):
        super().__init__()
        self.towers = towers

    def before(self, model, optimizer, loss_fn, x, y, micro_batches=1):
        super().before(model, optimizer, loss_fn, x, y, micro_batches)
        two_gamma = 2 * tolerance.gamma(tolerance.path_sums(model, len(x)))
        dg = self._step[3]
        for index, variable in enumerate(model.trainable_variables):
            if len(variable.shape) < 2:
                continue
            n, m = math.prod(variable.shape[:-1]), int(variable.shape[-1])
            r = min(n, m)
            eps = 2 * 2 * (n * r + m * r) * U + tolerance.gamma(n + m + self.towers)
            dg[index] = dg[index] + eps * self.towers * np.linalg.norm(dg[index] / two_gamma)


def tiny_model():
    return keras.Sequential([keras.Input(helpers.DATASET.input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(8, activation="relu"), keras.layers.Dense(10)])


@pytest.fixture(scope="module")
def full_rank_reference(tmp_path_factory):
    """One device on the 5 batches, with the bound of 4 towers (it grows with T, so it
    holds for 2 towers as well)."""
    config = helpers.small_config(str(tmp_path_factory.mktemp("reference")))
    bound = FullRankBound(TOWERS)
    reference, loss_sum = helpers.train_reference_model(config, helpers.batches(5),
                                                        tiny_model, bound)
    return [v.numpy() for v in reference.trainable_variables], loss_sum, bound


@pytest.mark.parametrize("towers", [2, 4])
def test_powersgd_full_rank_equals_one_device(towers, full_rank_reference, tmp_path):
    config = helpers.small_config(str(tmp_path), devices=f"cpu:{towers}",
                                  aggregation="powersgd:rank=64,min_compression=0,memory=none")
    trainer = helpers.build_trainer(config, tiny_model)
    assert sum(p is not None for p in trainer.aggregation.plans) == 2  # both kernels
    loss_sum = helpers.run_batches(trainer, helpers.batches(5))
    for weights in helpers.copy_weights(trainer):
        tolerance.assert_matches_reference(weights, loss_sum, full_rank_reference)


# ---- refusals ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,words", [
    ("powersgd:rank=0", "rank=0 is out of range: must be >= 1"),
    ("qsgd:levels=0", "levels=0 is out of range: must be >= 1"),
    ("qsgd:levels=1.5", "levels='1.5' is not an int"),
    ("powersgd:min_compression=-1", "min_compression=-1 is out of range"),
    ("signsgd:scaled=false,memory=residual", "use scaled=true or memory=none"),
    ("onebit:memory=some", "memory=some is out of range: must be one of none|residual"),
])
def test_bad_options_refused_in_one_line(spec, words, tmp_path):
    with pytest.raises(ConfigError) as error:
        helpers.small_config(str(tmp_path), devices="cpu:2", aggregation=spec).validated()
    assert "\n" not in str(error.value) and words in str(error.value), str(error.value)


@pytest.mark.parametrize("name", ["signsgd", "powersgd"])
def test_refused_across_workers_at_the_towers_only(name, tmp_path):
    """Their vote and their P, Q need the other workers' payloads, which a dense local sum
    cannot give: refused at --method_at=towers, naming --method_at=nodes, where they run
    (the default: tests/test_nodes_workers.py runs powersgd between real workers)."""
    context = settings.Context(request=devices.parse("cpu:2"),
                               workers=types.SimpleNamespace(num_workers=2), num_workers=2)
    config = helpers.small_config(str(tmp_path), devices="cpu:2", aggregation=name,
                                  method_at="towers")
    with pytest.raises(ConfigError) as error:
        exchange_checks.check(config.exchange, context)
    assert "\n" not in str(error.value) and f"--aggregation={name} across 2 workers" in str(
        error.value) and "--method_at=nodes" in str(error.value)
    config = helpers.small_config(str(tmp_path), devices="cpu:2", aggregation=name)
    exchange_checks.check(config.exchange, context)  # auto: at the nodes
