"""`sparta` and `sparta_diloco` (aggregation/local/sparta.py): the shared draw of the chosen
elements, the sparse averaging and DiLoCo's outer step against a numpy model of the
method op for op, the bytes against a hand count, fraction=1 against `localsgd:period=1`,
between nodes, and its refusals. Its identity options are checked against one device by
the contract test (tests/test_contract.py); between 2 workers by tests/test_nodes_workers.py.
"""

import numpy as np
import pytest
import tensorflow as tf

from mgloop.aggregation.local.sparta import chosen, chosen_count
from mgloop.cluster import devices
from mgloop.errors import ConfigError
from tests import helpers
from tests.copies_by_hand import (assert_copies_equal, inner_steps_by_hand, method_on_copies,
                                  trained_side_by_side)

F32 = np.float32
SHAPES = [(3, 4), (4,), (2, 3), (5,), (6,)]  # 12, 4, 6, 5, 6 elements
SEED = 11


@pytest.mark.parametrize("fraction, n, k", [
    (0.005, 200, 1), (0.005, 201, 2), (0.005, 10, 1), (1.0, 7, 7), (0.1, 30, 3),
    (0.25, 12, 3), (0.25, 4, 1), (0.25, 6, 2), (0.25, 5, 2), (0.3, 10, 3)])
def test_chosen_count_by_hand(fraction, n, k):
    """k = ceil(p n), p the decimal as written (0.3 * 10 is 3, not 4 by a float's excess)."""
    assert chosen_count(fraction, n) == k


def draw(seed, step, index, n, k, device="/device:CPU:0"):
    with tf.device(device):
        return chosen(seed, tf.constant(step, tf.int64), index, n, k).numpy()


def test_the_draw_is_a_subset_shared_by_every_device_and_a_function_of_seed_step_variable():
    """k distinct ascending indices in 0..n-1; the same on another device and when drawn
    again (a resumed run draws from its restored step); another step, variable or seed
    draws another subset; fraction 1 is every index in order."""
    devices.setup(devices.parse("cpu:2"))
    one = draw(SEED, 4, 2, 50, 7)
    assert one.dtype == np.int32 and len(one) == 7 and len(set(one)) == 7
    assert (np.diff(one) > 0).all() and 0 <= one[0] and one[-1] < 50
    np.testing.assert_array_equal(one, draw(SEED, 4, 2, 50, 7, "/device:CPU:1"))
    np.testing.assert_array_equal(one, draw(SEED, 4, 2, 50, 7))
    for other in (draw(SEED, 5, 2, 50, 7), draw(SEED, 4, 3, 50, 7), draw(SEED + 1, 4, 2, 50, 7)):
        assert not np.array_equal(one, other)
    np.testing.assert_array_equal(draw(SEED, 4, 2, 9, 9), np.arange(9))


def test_every_element_is_chosen_about_as_often():
    """n = 20, k = 5 over 400 steps: each index is chosen Binomial(400, 1/4) times, mean
    100, standard deviation 8.7; all within 5 standard deviations (a biased or a fixed
    draw is far outside)."""
    counts = np.zeros(20)
    for step in range(400):
        counts[draw(SEED, step, 0, 20, 5)] += 1
    assert counts.sum() == 2000
    assert np.abs(counts - 100).max() < 5 * np.sqrt(400 * 0.25 * 0.75)


def numpy_ring_mean(vectors):
    """ring.py's mean of T float32 vectors op for op: chunk c (sizes differing by at most
    one, larger first) summed v_{c+T-1} + (... + (v_{c+1} + v_c)), times fl(1/T)."""
    num, size = len(vectors), len(vectors[0])
    base, extra = divmod(size, num)
    out, start = np.empty(size, F32), 0
    for c in range(num):
        end = start + base + (c < extra)
        total = vectors[c][start:end]
        for j in range(1, num):
            total = vectors[(c + j) % num][start:end] + total
        out[start:end] = total * F32(1.0 / num)
        start = end
    return out


class NumpySparta:
    """The method in numpy float32: T copies v[c][i]; the chosen indices J given (drawn
    by `chosen`, tested above); with a period, DiLoCo's x and m (the same on every copy)."""

    def __init__(self, init, towers, period=None, lr=0.7, mu=0.9):
        self.v = [[w.copy() for w in init] for _ in range(towers)]
        self.x = [w.copy() for w in init]
        self.m = [np.zeros_like(w) for w in init]
        self.towers, self.period, self.lr, self.mu = towers, period, F32(lr), F32(mu)

    def sparse(self, spots):
        picked = [np.concatenate([self.v[c][i].reshape(-1)[j] for i, j in enumerate(spots)])
                  for c in range(self.towers)]
        means = np.split(numpy_ring_mean(picked), np.cumsum([len(j) for j in spots])[:-1])
        for c in range(self.towers):
            for i, (j, mean) in enumerate(zip(spots, means)):
                flat = self.v[c][i].reshape(-1).copy()
                flat[j] = mean
                self.v[c][i] = flat.reshape(self.v[c][i].shape)

    def outer(self):  # diloco, nesterov
        whole = [np.concatenate([w.reshape(-1) for w in self.v[c]]) for c in range(self.towers)]
        means = np.split(numpy_ring_mean(whole), np.cumsum([w.size for w in self.x])[:-1])
        for i, mean in enumerate(means):
            delta = self.x[i] - mean.reshape(self.x[i].shape)
            self.m[i] = self.mu * self.m[i] + delta
            self.x[i] = self.x[i] - self.lr * (delta + self.mu * self.m[i])
            for c in range(self.towers):
                self.v[c][i] = self.x[i].copy()

    def after_step(self, s, spots):
        self.sparse(spots)
        if self.period and (s + 1) % self.period == 0:
            self.outer()


def ring_bytes(elements, towers, element_bytes=4):
    """Bytes each tower sends in a ring all-reduce of `elements`, by hand: chunk c has
    floor(K/T) + [c < K mod T] elements; tower t sends chunks t, t-1, ..., t-T+2 in the
    reduce-scatter (all but t+1) and t+1, t, ..., t-T+3 in the all-gather (all but t+2)."""
    base, extra = divmod(elements, towers)
    size = [base + (c < extra) for c in range(towers)]
    return [(2 * elements - size[(t + 1) % towers] - size[(t + 2) % towers]) * element_bytes
            for t in range(towers)]


@pytest.mark.parametrize("towers, spec, period", [
    (2, "sparta:fraction=0.25", None),
    (3, "sparta:fraction=0.25", None),
    (4, "sparta:fraction=0.5", None),
    (2, "sparta_diloco:fraction=0.25,period=3,outer_lr=0.7,outer_momentum=0.9", 3),
    (3, "sparta_diloco:fraction=0.25,period=3,outer_lr=0.7,outer_momentum=0.9", 3),
])
def test_equals_numpy_model(towers, spec, period):
    """Hand-made inner progress (each copy moved by its own seeded noise each step), 7
    steps: after every step every copy's parameters (and DiLoCo's x and m) equal the
    numpy model's bit for bit (the same float32 ops in the ring's order). The traced
    traffic, by hand: the ring of the sum_i k_i chosen values every step (0.25: k = 3, 1,
    2, 2, 2 = 10 elements; 0.5: 6, 2, 3, 3, 3 = 17), float32, and no index; DiLoCo's ring of
    all 33 parameters on the occasion "sync"."""
    tf.random.set_seed(SEED)
    rng = np.random.default_rng(5)
    init = [rng.standard_normal(shape).astype(F32) for shape in SHAPES]
    method, copies = method_on_copies(spec, towers, init, step_fn=False)
    assert method.seed == SEED
    fraction = method.options.fraction
    want_counts = {0.25: [3, 1, 2, 2, 2], 0.5: [6, 2, 3, 3, 3]}[fraction]
    assert method.counts == want_counts
    with method.step():
        after_update = tf.function(lambda: method.after_update(copies)).get_concrete_function()
    every = method.traffic.of_occasion("every step")
    assert [every.sent[d] for d in every.devices()] == ring_bytes(sum(want_counts), towers)
    sent = ring_bytes(sum(want_counts), towers)  # tower t receives what t - 1 sends
    assert [every.received[d] for d in every.devices()] == sent[-1:] + sent[:-1]
    sync = method.traffic.of_occasion("sync")
    assert sum(sync.sent.values()) == (2 * (towers - 1) * 33 * 4 if period else 0)
    model = NumpySparta(init, towers, period)
    for s in range(7):
        inner_steps_by_hand(model.v, copies, rng, SHAPES)
        method.step_counter.assign(s)
        after_update()
        spots = [draw(SEED, s, i, int(np.prod(shape)), k)
                 for i, (shape, k) in enumerate(zip(SHAPES, want_counts))]
        model.after_step(s, spots)
        for c, copy in enumerate(copies):
            for i, variable in enumerate(copy.trainable):
                np.testing.assert_array_equal(variable.numpy(), model.v[c][i],
                                              err_msg=f"step {s} copy {c} variable {i}")
        if period:
            for i in range(len(SHAPES)):
                np.testing.assert_array_equal(method._start[0][i].numpy(), model.x[i])
                np.testing.assert_array_equal(method._momentum[0][i].numpy(), model.m[i])
    if fraction < 1 and period is None:  # the copies differ off the chosen elements
        assert max(np.abs(model.v[0][i] - model.v[1][i]).max() for i in range(5)) > 0.01


@pytest.mark.parametrize("towers", [2, 4])
def test_fraction_one_is_localsgd_period_one_bit_for_bit(towers, tmp_path):
    """fraction=1 chooses every element in order: the same vector through the same ring as
    `localsgd:period=1`, so after 3 steps every copy's weights and optimizer slots, and the
    bytes per step, are equal bit for bit."""
    (local, want), (sparta, got) = trained_side_by_side(
        tmp_path, ("localsgd:period=1", "sparta:fraction=1"), towers, 3)
    assert_copies_equal(got, want)
    for sc, lc in zip(sparta.copies, local.copies):
        for a, b in zip(sc.optimizer.variables, lc.optimizer.variables):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert sparta.aggregation.traffic.as_dict() == local.aggregation.traffic.as_dict()


def test_between_four_nodes_it_trains(tmp_path):
    """--nodes=4 on 4 towers (the method on the 4 node leaders), default fraction 0.005:
    it trains, stays finite, the copies differ (off the chosen elements), and the bytes
    between nodes per step are the ring of sum_i ceil(0.005 n_i) float32 values among 4."""
    config = helpers.small_config(str(tmp_path), devices="cpu:4", nodes=4, aggregation="sparta")
    trainer = helpers.build_trainer(config)
    start = helpers.copy_weights(trainer)[0]
    helpers.run_batches(trainer, helpers.batches(4))
    copies = helpers.copy_weights(trainer)
    assert all(np.isfinite(w).all() for weights in copies for w in weights)
    assert any(np.abs(w - w0).max() > 1e-3 for w, w0 in zip(copies[0], start))
    assert any(not np.array_equal(a, b) for a, b in zip(copies[0], copies[3]))
    chosen_total = sum(chosen_count(0.005, w.size) for w in start)
    between = trainer.aggregation.traffic.part("between", "gradient")
    assert sorted(between.sent.values()) == sorted(ring_bytes(chosen_total, 4))


def test_between_nodes_the_leaders_agree_on_the_chosen_elements(tmp_path):
    """2 nodes of 2 towers, sparta_diloco with period 3: inside a node the copies are equal
    bit for bit after every step (the leader's parameters handed on); between the nodes
    the elements chosen at that step are equal, and, after the outer step (s = 2), all."""
    tf.random.set_seed(3)
    config = helpers.small_config(str(tmp_path), devices="cpu:4", nodes=2, optimizer="sgd",
                                  aggregation="sparta_diloco:fraction=0.05,period=3")
    trainer = helpers.build_trainer(config)
    inner = trainer.aggregation.inner
    for s, batch in enumerate(helpers.batches(4)):
        helpers.run_batches(trainer, [batch])
        copies = helpers.copy_weights(trainer)
        for a, b in ((0, 1), (2, 3)):
            for x, y in zip(copies[a], copies[b]):
                np.testing.assert_array_equal(x, y, err_msg=f"step {s}")
        for i, (x, y) in enumerate(zip(copies[0], copies[2])):
            spots = draw(inner.seed, s, i, x.size, inner.counts[i])
            np.testing.assert_array_equal(x.reshape(-1)[spots], y.reshape(-1)[spots])
            assert np.array_equal(x, y) == (s == 2), (s, i)


@pytest.mark.parametrize("spec, message", [
    ("sparta:fraction=0", r"sparta option fraction=0(\.0)? is out of range: must be > 0"),
    ("sparta:fraction=1.5", r"sparta option fraction=1.5 is out of range"),
    ("sparta_diloco:period=0", r"sparta_diloco option period=0 is out of range: must be >= 1"),
])
def test_bad_options_refused_in_one_line(spec, message, tmp_path):
    """Refused by Config.validated(), before any device or variable exists."""
    with pytest.raises(ConfigError, match=message) as error:
        helpers.small_config(str(tmp_path), devices="cpu:2", aggregation=spec).validated()
    assert "\n" not in str(error.value)
