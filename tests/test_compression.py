"""The sparsifiers of mgloop/aggregation/compression (topk, randomk, threshold, dgc).

Against small numpy models of themselves on hand-made tower gradients (selected values
and indices, shared random indices, DGC's momentum correction and masking), the
error-feedback identity (bit-exact), replicas bit-identical inside a compiled exchange,
exact byte counts, the worker decomposition of the local stage, lossless settings vs
one device, and one-line refusals. Their checkpoint/resume (residuals, momenta, step
counter) is checked, bit-identically, by tests/test_contract.py for every method.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from mgloop import aggregation
from mgloop.cluster import devices
from mgloop.aggregation.compression.topk import kept
from mgloop.errors import ConfigError
from tests import helpers, tolerance

SHAPES = [(3, 4), (7,), (1,)]


def make(spec, towers, shapes=SHAPES):
    method = aggregation.make(spec, devices.setup(devices.parse(f"cpu:{towers}")))
    variables = [tf.Variable(tf.zeros(s)) for s in shapes]
    method.build(variables)
    return method, variables


def gradients(towers, shapes=SHAPES, seed=0, scale=1.0):
    """values[t][i]: distinct magnitudes (no ties in a top-k), float32."""
    rng = np.random.default_rng(seed)
    return [[((rng.permutation(np.prod(s)).reshape(s) + 1.0) * scale / np.prod(s)
              * rng.choice([-1.0, 1.0], s)).astype(np.float32) for s in shapes]
            for _ in range(towers)]


def exchange(method, variables, values, compiled=False):
    """out[c][i] as numpy; the payloads compressed, per (tower, variable), recorded.
    `compiled`: through one tf.function of the method's reduce, traced once and called on
    every exchange of the method (as the compiled step calls it)."""
    placed = []
    for device, per_tower in zip(method.devices.towers, values):
        with tf.device(device):
            placed.append([tf.constant(g) for g in per_tower])
    if compiled and _COMPILED.get("method") is not method:
        _COMPILED.update(method=method, reduce=tf.function(method.reduce))
    run = _COMPILED["reduce"] if compiled else method.reduce
    return [[v.numpy() for v in copy] for copy in run(placed, variables)]


_COMPILED = {}  # the method last exchanged compiled and its tf.function (kept for its next)


def spy_payloads(method):
    """{(tower, variable): [the dense c_t sent, per exchange]} (eager exchanges only)."""
    sent = {}
    compress = method.compress

    def recording(x, site):
        payload = compress(x, site)
        rounded = method.wire_round(tuple(payload))
        sent.setdefault((site.tower, site.index), []).append(
            method.decompress(rounded, site).numpy())
        return payload
    method.compress = recording
    return sent


def topk_model(x, ratio):
    """(c, e, indices) of numpy top-k on the flat x."""
    k = kept(ratio, x.size)
    index = np.argsort(-np.abs(x), kind="stable")[:k]
    c = np.zeros_like(x)
    c[index] = x[index]
    return c, x - c, np.sort(index)


def test_topk_selects_the_largest_and_feeds_back_the_rest():
    method, variables = make("topk:ratio=0.25", 2)
    residual = [[np.zeros(int(np.prod(s)), np.float32) for s in SHAPES] for _ in range(2)]
    sent = spy_payloads(method)
    for step in range(2):
        values = gradients(2, seed=step)
        out = exchange(method, variables, values)
        for i, shape in enumerate(SHAPES):
            cs = []
            for t in range(2):
                x = values[t][i].ravel() + residual[t][i]
                c, residual[t][i], index = topk_model(x, 0.25)
                np.testing.assert_array_equal(np.flatnonzero(sent[t, i][step]), index)
                np.testing.assert_array_equal(sent[t, i][step], c)
                np.testing.assert_array_equal(method.residuals[t][i].numpy().ravel(),
                                              residual[t][i])
                cs.append(c)
            for copy in out:
                np.testing.assert_allclose(copy[i].ravel(), (cs[0] + cs[1]) / 2, rtol=1e-6)


@pytest.mark.parametrize("spec", ["topk:ratio=0.3", "randomk:ratio=0.3,memory=residual",
                                  "threshold:value=0.3", "dgc:ratio=0.3,momentum=0"])
def test_error_feedback_identity_is_exact(spec):
    """c_t + e_t(new) == g_t + e_t(old), bit for bit (float32), over three exchanges."""
    method, variables = make(spec, 2)
    sent = spy_payloads(method)
    for step in range(3):
        values = gradients(2, seed=10 + step)
        before = [[r.numpy().ravel() for r in per_tower] for per_tower in method.residuals]
        exchange(method, variables, values)
        for t in range(2):
            for i in range(len(SHAPES)):
                after = method.residuals[t][i].numpy().ravel()
                np.testing.assert_array_equal(sent[t, i][step] + after,
                                              values[t][i].ravel() + before[t][i])
                assert np.any(after != 0) or step == 0 or SHAPES[i] == (1,)


def test_randomk_indices_are_shared_by_the_towers_and_new_each_step():
    method, variables = make("randomk:ratio=0.25", 4, [(40,)])
    sent = spy_payloads(method)
    patterns = []
    for step in range(2):
        values = gradients(4, [(40,)], seed=step)
        out = exchange(method, variables, values)
        chosen = [np.flatnonzero(sent[t, 0][step]) for t in range(4)]
        assert all(np.array_equal(c, chosen[0]) for c in chosen) and len(chosen[0]) == 10
        expected = np.zeros(40, np.float32)  # unbiased without memory: n/k = 4 on I
        for t in range(4):
            expected[chosen[0]] += 4.0 * values[t][0][chosen[0]]
        for copy in out:
            np.testing.assert_allclose(copy[0], expected / 4, rtol=1e-6)
        patterns.append(chosen[0])
    assert not np.array_equal(patterns[0], patterns[1])


@pytest.mark.parametrize("clip_norm", [0.0, 0.05])
def test_dgc_momentum_correction_and_factor_masking(clip_norm):
    towers, m, ratio = 2, 0.9, 0.25
    method, variables = make(f"dgc:ratio={ratio},momentum={m},clip_norm={clip_norm}", towers)
    u = [[np.zeros(int(np.prod(s))) for s in SHAPES] for _ in range(towers)]
    v = [[np.zeros(int(np.prod(s))) for s in SHAPES] for _ in range(towers)]
    for step in range(3):
        values = gradients(towers, seed=20 + step)
        out = exchange(method, variables, values)
        for i in range(len(SHAPES)):
            total = 0.0
            for t in range(towers):
                g = values[t][i].ravel().astype(np.float64)
                if clip_norm:  # local clipping at clip_norm * sqrt(T) (mean semantics)
                    g = g * min(1.0, clip_norm * math.sqrt(towers) / np.linalg.norm(g))
                u[t][i] = m * u[t][i] + g
                x = v[t][i] + u[t][i]
                c, v[t][i], index = topk_model(x, ratio)
                u[t][i][index] = 0.0  # factor masking
                total = total + c
            for copy in out:
                np.testing.assert_allclose(copy[i].ravel(), total / towers, rtol=1e-5,
                                           atol=1e-6)
            for t in range(towers):
                np.testing.assert_allclose(method.extra[t][i]["momentum"].numpy().ravel(),
                                           u[t][i], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", ["topk:ratio=0.3", "randomk:ratio=0.3"])
def test_replicas_are_bit_identical_in_a_compiled_exchange(spec):
    """Grappler regroups a chain of adds per tower; the gathered sum must not care."""
    method, variables = make(spec, 4)
    out = exchange(method, variables, gradients(4, seed=30), compiled=True)
    for copy in out[1:]:
        for a, b in zip(copy, out[0]):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("transport_dtype, value_bytes", [("float32", 4), ("bfloat16", 2)])
def test_topk_traffic_is_k_values_and_k_narrowest_indices(transport_dtype, value_bytes):
    """Ring all-gather: each tower sends and receives (T-1) payloads of k values + k indices,
    each index at the narrowest integer type for n (uint8 up to 256, uint16 up to 65536)."""
    shapes, towers = [(10, 10), (33,), (1,), (300,)], 4
    method = aggregation.make("topk:ratio=0.1", devices.setup(devices.parse("cpu:4")),
                              transport_dtype)
    variables = [tf.Variable(tf.zeros(s)) for s in shapes]
    method.build(variables)
    exchange(method, variables, gradients(towers, shapes))
    ks, index_bytes = [10, 4, 1, 30], [1, 1, 1, 2]  # ceil(0.1 n) for n = 100, 33, 1, 300
    per_tower = (towers - 1) * sum(k * (value_bytes + i) for k, i in zip(ks, index_bytes))
    assert method.traffic.as_dict() == {f"CPU:{t}": {"sent": per_tower, "received": per_tower}
                                        for t in range(towers)}


def test_randomk_traffic_is_a_ring_all_reduce_of_k_values():
    method, variables = make("randomk:ratio=0.25", 4, [(40,)])
    exchange(method, variables, gradients(4, [(40,)]))
    # 10 values cut in 4 chunks (3, 3, 2, 2): each tower sends 3 chunks twice
    sent = {t: method.traffic.sent[f"CPU:{t}"] for t in range(4)}
    assert sum(sent.values()) == 2 * 3 * 10 * 4 and max(sent.values()) <= 2 * 3 * 3 * 4


@pytest.mark.parametrize("spec", ["topk:ratio=0.3", "dgc:ratio=0.3,momentum=0.5"])
def test_two_workers_of_two_towers_sum_as_one_worker_of_four(spec):
    """The cross-worker local stage: each worker's sum (average=False) over its 2 towers,
    added, equals the 4-tower sum within float32 rounding, residuals carried over steps."""
    whole, variables = make(spec, 4)
    sent = spy_payloads(whole)
    halves = [make(spec, 2)[0] for _ in range(2)]
    for step in range(3):
        values = gradients(4, seed=40 + step)
        expected = exchange(whole, variables, values)[0]
        parts = []
        for w, half in enumerate(halves):
            placed = []
            for device, per_tower in zip(half.devices.towers, values[2 * w:2 * w + 2]):
                with tf.device(device):
                    placed.append([tf.constant(g) for g in per_tower])
            parts.append([v.numpy() for v in half.reduce(placed, variables, average=False)[0]])
        for i, shape in enumerate(SHAPES):
            # both orders within gamma_3 sum_t |c_t| of the exact sum (the /4 is exact)
            bound = 2 * 3.01 * 2.0 ** -24 * sum(np.abs(sent[t, i][step]) for t in range(4)) / 4
            tolerance.assert_within([(parts[0][i] + parts[1][i]) / 4], [expected[i]],
                                    [bound.reshape(shape)])


@pytest.mark.parametrize("spec, towers", [("topk:ratio=1", 2), ("topk:ratio=1", 4),
                                          ("randomk:ratio=1", 4), ("threshold:value=0", 2)])
def test_lossless_settings_equal_one_device(spec, towers, tmp_path):
    config = helpers.small_config(str(tmp_path), devices=f"cpu:{towers}", aggregation=spec)
    trainer = helpers.build_trainer(config)
    loss_sum = helpers.run_batches(trainer, helpers.batches(5))
    expected = reference(str(tmp_path / "reference"))
    copies = helpers.copy_weights(trainer)
    for weights in copies:
        tolerance.assert_matches_reference(weights, loss_sum, expected)
        for a, b in zip(weights, copies[0]):
            np.testing.assert_array_equal(a, b)


_REFERENCE = {}


def reference(logdir):
    if not _REFERENCE:
        _REFERENCE["run"] = helpers.train_reference_bounded(helpers.small_config(logdir),
                                                            helpers.batches(5))
    return _REFERENCE["run"]


@pytest.mark.parametrize("spec, words", [
    ("topk:ratio=0", "ratio=0 is out of range: must be > 0.0 and <= 1.0"),
    ("topk:ratio=1.5", "ratio=1.5 is out of range"),
    ("randomk:ratio=-1", "ratio=-1 is out of range"),
    ("dgc:momentum=1", "momentum=1 is out of range: must be >= 0.0 and < 1.0"),
    ("threshold:value=-0.1", "value=-0.1 is out of range: must be >= 0.0"),
    ("topk:memory=sometimes", "memory=sometimes is out of range: must be one of none|residual"),
])
def test_bad_options_are_refused_in_one_line(spec, words, tmp_path):
    with pytest.raises(ConfigError) as error:
        helpers.small_config(str(tmp_path), devices="cpu:2", aggregation=spec).validated()
    assert "\n" not in str(error.value) and words in str(error.value)


def test_dgc_refuses_an_optimizer_that_adds_momentum(tmp_path):
    with pytest.raises(ConfigError) as error:
        helpers.small_config(str(tmp_path), devices="cpu:2", aggregation="dgc",
                             optimizer="momentum").validated()
    assert "\n" not in str(error.value) and "--optimizer=sgd" in str(error.value)
    for fine in (dict(aggregation="dgc", optimizer="sgd"),
                 dict(aggregation="dgc:momentum=0", optimizer="adam")):
        helpers.small_config(str(tmp_path), devices="cpu:2", **fine).validated()


def test_a_compressor_that_defines_unpack_alone_is_refused_in_one_line():
    """The receivers unpack every wire they received with `unpack_rows`: a method that
    defined only `unpack` would have its packed bytes read as the payload."""
    from mgloop.aggregation.compression.base import Compressed
    with pytest.raises(TypeError) as error:
        type("OwnPacking", (Compressed,), {"unpack": lambda self, wire, site: wire})
    assert "\n" not in str(error.value) and "define unpack_rows" in str(error.value)


def test_explicit_packing_is_refused(tmp_path):
    with pytest.raises(ConfigError) as error:
        helpers.small_config(str(tmp_path), devices="cpu:2", aggregation="randomk",
                             pack_bytes=1024).validated()
    assert "\n" not in str(error.value) and "per-variable residuals" in str(error.value)


def test_memory_defaults_follow_the_papers():
    defaults = {name: aggregation.parse(name)[1].memory
                for name in ("topk", "randomk", "threshold", "dgc")}
    assert defaults == {"topk": "residual", "randomk": "none", "threshold": "residual",
                        "dgc": "residual"}
