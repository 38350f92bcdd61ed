"""`signsgd:bits=1` (aggregation/compression/signs.py): one bit per sign, sign(0) a coin
from the tower's stream, the packed signs always gathered. Against a numpy model of the
vote op for op on hand-made values with zeros (exact: the values are chosen so that every
float32 sum in it is exact), the bytes against a hand count, the coins' stream, the
declared bound, `bits=2` unchanged, training between nodes. Between 2 real workers:
tests/test_nodes_workers.py (TWO_WORKERS).
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from mgloop import aggregation
from mgloop.aggregation.compression.signs import coin_signs
from mgloop.cluster import devices
from mgloop.errors import ConfigError
from tests import helpers

F32 = np.float32
SHAPES = [(2, 4), (4,), (3, 4)]  # n = 8, 4, 12: ceil(n/8) = 1, 1, 2 bytes of signs
# Tower values: small dyadic numbers and many zeros (a row zero on every tower), so
# ||x_t||_1 / n and the towers' sum of those are exact in float32.


def tower_values(towers, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(towers):
        per = []
        for shape in SHAPES:
            x = rng.choice(np.array([0.0, 0.0, 0.5, -0.5, 1.0, -2.0, 0.25], F32), shape)
            per.append(x.astype(F32))
        out.append(per)
    out[0][1][:] = 0.0  # one tower all zeros on the vector: every sign a coin
    for t in range(towers):
        out[t][2][0, :] = 0.0  # a row zero on every tower: the vote of coins alone
    return out


def made(spec, towers):
    device_set = devices.setup(devices.parse(f"cpu:{towers}"))
    method = aggregation.make(spec, device_set)
    with tf.device(device_set.towers[0]):
        variables = [tf.Variable(tf.zeros(shape)) for shape in SHAPES]
    method.build(variables)
    return method, variables


def exchange(method, values, variables, traced=True):
    """One reduce (traced, as in a step; else eager): out[c][i] as numpy; the traffic of
    that trace."""
    placed = []
    for device, per_tower in zip(method.devices.towers, values):
        with tf.device(device):
            placed.append([tf.constant(v) for v in per_tower])
    with method.step():
        reduce = lambda: method.reduce(placed, variables, average=True)  # noqa: E731
        out = tf.function(reduce)() if traced else reduce()
    return [[v.numpy() for v in per_copy] for per_copy in out]


def coins(method, values):
    """The coins every tower draws at this exchange: at site.tower_seed, before it runs."""
    out = []
    for t, device in enumerate(method.devices.towers):
        with tf.device(device):
            out.append([coin_signs([v.size], method.site(t, i, tf.constant(v.reshape(-1)))
                                   .tower_seed).numpy() for i, v in enumerate(values[t])])
    return out


def numpy_vote(xs, coins_t, towers, scaled, one_bit):
    """signs s_t (1 bit: coins where x = 0; 2 bits: 0 there), vote = sign(sum_t s_t) (the
    integer sum), out = (vote (float32) * sum_t ||x_t||_1 / n) * fl(1/T); unscaled:
    (vote * T) * fl(1/T)."""
    signs = [np.where(x > 0, 1, np.where(x < 0, -1, c.reshape(x.shape) if one_bit else 0))
             .astype(np.int32) for x, c in zip(xs, coins_t)]
    vote = np.sign(np.sum(signs, axis=0)).astype(F32)
    if scaled:
        total = F32(0)
        for x in xs:
            total = total + F32(np.abs(x).sum()) / F32(x.size)
        return (vote * total) * F32(1.0 / towers), signs
    return (vote * F32(towers)) * F32(1.0 / towers), signs


@pytest.mark.parametrize("towers, scaled, bits", [
    (2, True, 1), (3, True, 1), (4, True, 1), (3, False, 1), (4, False, 1),
    (3, True, 2), (4, False, 2)])  # bits=2: today's ternary vote, unchanged
def test_vote_with_zeros_equals_numpy_model(towers, scaled, bits):
    """Every replica's output equals the numpy vote bit for bit (and, bits=1, the bytes
    equal a hand count); with bits=1 no sign is 0
    (the coins at x = 0 take part, so a row zero on every tower votes the coins' majority,
    0 only on a tie of an even T), with bits=2 a row zero everywhere votes 0."""
    tf.random.set_seed(7)
    spec = f"signsgd:bits={bits},scaled={str(scaled).lower()}"
    method, variables = made(spec, towers)
    values = tower_values(towers)
    drawn = coins(method, values)
    out = exchange(method, values, variables)
    for i in range(len(SHAPES)):
        want, signs = numpy_vote([values[t][i] for t in range(towers)],
                                 [drawn[t][i] for t in range(towers)], towers, scaled,
                                 bits == 1)
        for c in range(towers):
            np.testing.assert_array_equal(out[c][i], want, err_msg=f"copy {c} variable {i}")
        if bits == 1:
            assert all((np.abs(s) == 1).all() for s in signs)
        elif i == 2:  # ternary: sign(0) = 0, the row zero everywhere votes 0
            assert (want[0] == 0).all()
    zero_row = out[0][2][0]
    if bits == 1 and towers % 2:  # odd T: the coins' majority, never 0
        assert (zero_row != 0).all()
    if bits == 1:  # the bytes by hand
        assert_one_bit_bytes(method, towers, scaled)


def assert_one_bit_bytes(method, towers, scaled):
    """bits=1: every tower sends its packed signs and its scale to T-1 towers (the ring's
    all-gather), ceil(n/8) bytes + 4 per variable: (T-1) (1 + 4 + 1 + 4 + 2 + 4) = 16 (T-1)
    bytes each, or (T-1) (1 + 1 + 2) = 4 (T-1) unscaled; the same received."""
    each = (towers - 1) * (16 if scaled else 4)
    assert sorted(method.traffic.sent.values()) == [each] * towers
    assert sorted(method.traffic.received.values()) == [each] * towers
    assert each == (towers - 1) * sum(math.ceil(math.prod(s) / 8) + 4 * scaled for s in SHAPES)


def test_the_coins_are_the_towers_own_and_fresh_each_step():
    """bits=1 on 3 towers: each tower's coins differ from the others', both signs occur,
    the next exchange draws others (the exchange count is in the seed), and a fresh
    method with the same --seed draws the same (a resumed run: the count is restored)."""
    tf.random.set_seed(7)
    method, variables = made("signsgd:bits=1", 3)
    values = tower_values(3)
    first = coins(method, values)
    assert not np.array_equal(first[0][2], first[1][2])
    assert set(np.concatenate([c[2] for c in first])) == {-1, 1}
    exchange(method, values, variables)
    assert not np.array_equal(coins(method, values)[0][2], first[0][2])
    again, _ = made("signsgd:bits=1", 3)
    np.testing.assert_array_equal(coins(again, values)[0][2], first[0][2])


@pytest.mark.parametrize("memory", ["none", "residual"])
def test_within_declared_bound(memory):
    """As the contract checks a lossy method: 6 exchanges of a fresh instance on 3 towers,
    stand-ins of varied scale with zeros, each within rho_n * G of the exact mean."""
    method, variables = made(f"signsgd:bits=1,memory={memory}", 3)
    rng = np.random.default_rng(0)
    largest = np.zeros(len(SHAPES))
    worst = 0.0
    for scale in (1.0, 0.1, 3.0, 0.01, 1.0, 0.3):
        values = [[(rng.standard_normal(s) * (rng.random(s) > 0.3) * scale).astype(F32)
                   for s in SHAPES] for _ in range(3)]
        out = exchange(method, values, variables, traced=False)
        largest = np.maximum(largest, [max(np.linalg.norm(values[t][i]) for t in range(3))
                                       for i in range(len(SHAPES))])
        for i, shape in enumerate(SHAPES):
            rho = method.error_bound_for(method.options, 3, math.prod(shape))
            exact = np.mean([values[t][i] for t in range(3)], axis=0, dtype=np.float64)
            error = np.linalg.norm(out[0][i] - exact)
            assert error <= rho * largest[i]
            worst = max(worst, error / largest[i])
    assert worst > 1e-3


def test_between_nodes_it_trains(tmp_path):
    """--nodes=2 on 4 towers (the method on the 2 node leaders): it trains, stays finite,
    every copy equal; the bytes between nodes per step are each leader's packed signs and
    scales of every variable, once, to the other: sum_i ceil(n_i / 8) + 4."""
    config = helpers.small_config(str(tmp_path), devices="cpu:4", nodes=2,
                                  aggregation="signsgd:bits=1", learning_rate=0.01)
    trainer = helpers.build_trainer(config)
    start = helpers.copy_weights(trainer)[0]
    helpers.run_batches(trainer, helpers.batches(3))
    copies = helpers.copy_weights(trainer)
    assert all(np.isfinite(w).all() for weights in copies for w in weights)
    assert any(np.abs(w - w0).max() > 1e-4 for w, w0 in zip(copies[0], start))
    for weights in copies[1:]:
        for a, b in zip(weights, copies[0]):
            np.testing.assert_array_equal(a, b)
    between = trainer.aggregation.traffic.part("between", "gradient")
    want = sum(math.ceil(w.size / 8) + 4 for w in start)
    assert sorted(between.sent.values()) == [want, want]


def test_bits_three_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"signsgd option bits=3 is out of range: must be "
                                          r"one of 1\|2$") as error:
        helpers.small_config(str(tmp_path), devices="cpu:2",
                             aggregation="signsgd:bits=3").validated()
    assert "\n" not in str(error.value)
