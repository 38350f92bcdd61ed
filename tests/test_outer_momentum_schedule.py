"""Pier's outer-momentum warmup and decay (aggregation/local/outer_schedule.py) on the DiLoCo
family: the schedule against its formula by hand, `diloco` with them against a numpy model
of the outer step op for op, off and constant settings against the plain method bit for bit,
the warmup's gradient mean, a resume mid-decay, the other members (streaming_diloco,
sparta_diloco, noloco) taking the same schedule, and the refusals in one line.
"""

import types

import numpy as np
import pytest
import tensorflow as tf

from mgloop import aggregation
from mgloop.aggregation import options as options_lib
from mgloop.aggregation.local.outer_schedule import check_run, momentum_at
from mgloop.errors import ConfigError
from tests import helpers
from tests.copies_by_hand import assert_copies_equal, method_on_copies
from tests.test_sparta import numpy_ring_mean

F32 = np.float32
SHAPES = [(3, 4), (4,), (2, 3), (5,)]
STEPS = 12


def pier(mu=0.9, start=0.99, middle=0.95, decay=8, t=None, warmup=0):
    """The schedule by hand (module top of outer_schedule.py), t = s + 1 steps done."""
    if not decay:
        return mu
    t = t - warmup
    return start if 2 * t <= decay else (middle if t <= decay else mu)


def test_schedule_by_hand():
    """D = 8: the outer steps closing steps t = 1..4 take mu_1, t = 5..8 mu_2, t > 8 mu; the
    step counter's tensor gives the same float32 values; D = 0 is the option itself."""
    _, options = aggregation.parse("diloco:period=2,momentum_decay=8")
    got = [momentum_at(options, s) for s in range(12)]
    assert got == [0.99] * 4 + [0.95] * 4 + [0.9] * 4
    assert got == [pier(t=s + 1) for s in range(12)]
    tensors = [momentum_at(options, tf.constant(s, tf.int64)).numpy() for s in range(12)]
    assert tensors == [F32(x) for x in got]
    _, odd = aggregation.parse("diloco:period=2,momentum_decay=9,decay_start=0.5,"
                               "decay_middle=0.7,outer_momentum=0.8")
    assert [momentum_at(odd, s) for s in range(11)] == [0.5] * 4 + [0.7] * 5 + [0.8] * 2
    _, late = aggregation.parse("diloco:period=2,momentum_warmup=4,momentum_decay=8")
    assert [momentum_at(late, s) for s in range(4, 16)] == got  # after the warmup
    _, off = aggregation.parse("diloco:outer_momentum=0.8")
    assert momentum_at(off, 3) == 0.8 and momentum_at(off, tf.constant(3)) == 0.8


class NumpyDiLoCo:
    """DiLoCo's outer step in numpy float32, op for op (local_steps.py), with mu_k given."""

    def __init__(self, init, towers, period, lr, nesterov, mus, warmup=0):
        self.warmup, self.mu = warmup, F32(0.9)
        self.v = [[w.copy() for w in init] for _ in range(towers)]
        self.x = [w.copy() for w in init]
        self.m = [np.zeros_like(w) for w in init]
        self.towers, self.period, self.lr, self.nesterov, self.mus = (towers, period, F32(lr),
                                                                      nesterov, mus)

    def after_step(self, s):
        if (s + 1) % self.period:
            return
        if s + 1 <= self.warmup:  # Pier's warmup: m filled from the (equal) copies, no step
            for i in range(len(self.x)):
                self.m[i] = self.mu * self.m[i] + (self.x[i] - self.v[0][i])
                self.x[i] = self.v[0][i].copy()
            return
        mu = F32(self.mus(s))
        whole = [np.concatenate([w.reshape(-1) for w in self.v[c]]) for c in range(self.towers)]
        means = np.split(numpy_ring_mean(whole), np.cumsum([w.size for w in self.x])[:-1])
        for i, mean in enumerate(means):
            delta = self.x[i] - mean.reshape(self.x[i].shape)
            self.m[i] = mu * self.m[i] + delta
            step = delta + mu * self.m[i] if self.nesterov else self.m[i]
            self.x[i] = self.x[i] - self.lr * step
            for c in range(self.towers):
                self.v[c][i] = self.x[i].copy()


def progress(towers, seed=5, warmup=0):
    """The initial parameters and each step's hand-made inner progress of every copy (the
    same move on every copy in the first `warmup` steps: synchronous training)."""
    rng = np.random.default_rng(seed)
    init = [rng.standard_normal(shape).astype(F32) for shape in SHAPES]
    moves = [[[F32(0.1) * rng.standard_normal(shape).astype(F32) for shape in SHAPES]
              for _ in range(towers)] for _ in range(STEPS)]
    for s in range(warmup):
        moves[s] = [moves[s][0]] * towers
    return init, moves


def run(spec, towers, init, moves, steps=range(STEPS), method=None, every=None):
    """`spec` on copies moved by `moves` (each copy's variable += its move) after every step;
    `every(s, method, copies)` after each step."""
    if method is None:
        method, copies, after_update = method_on_copies(spec, towers, init)
    else:
        method, copies, after_update = method
    for s in steps:
        for copy, moved in zip(copies, moves[s]):
            for variable, move in zip(copy.trainable, moved):
                variable.assign(variable.numpy() + move)
        method.step_counter.assign(s)
        after_update()
        if every:
            every(s, method, copies)
    return method, copies


def weights(copies):
    return [[v.numpy() for v in copy.trainable] for copy in copies]


def state(method):
    return [v.numpy() for v in method.state_variables]


@pytest.mark.parametrize("towers, nesterov, decay, warmup", [
    (2, True, 8, 0), (3, False, 8, 0), (2, True, 0, 0), (3, True, 6, 4),
    (2, False, 0, 4)])
def test_diloco_equals_numpy_model(towers, nesterov, decay, warmup):
    """H = 2, 12 steps of hand-made progress (the same on every copy in the warmup, as
    synchronous training leaves them): after every step every copy's parameters, x and m
    equal the numpy model's with mu_k = the schedule by hand and, in the warmup, m filled
    with no outer step, bit for bit (the same float32 ops in the ring's order; mu_k the
    float32 of the decimal, as the option's constant). decay = warmup = 0: the model with
    the constant mu, i.e. today's diloco."""
    init, moves = progress(towers, warmup=warmup)
    spec = f"diloco:period=2,outer_lr=0.7,outer_momentum=0.9,nesterov={nesterov}"
    spec += f",momentum_decay={decay}" if decay else ""
    spec += f",momentum_warmup={warmup}" if warmup else ""
    model = NumpyDiLoCo(init, towers, 2, 0.7, nesterov,
                        lambda s: pier(decay=decay, t=s + 1, warmup=warmup), warmup)

    def check(s, method, copies):
        for c in range(towers):
            for i in range(len(SHAPES)):
                model.v[c][i] = model.v[c][i] + moves[s][c][i]
        model.after_step(s)
        for c, copy in enumerate(copies):
            for i, variable in enumerate(copy.trainable):
                np.testing.assert_array_equal(variable.numpy(), model.v[c][i],
                                              err_msg=f"step {s} copy {c} variable {i}")
                np.testing.assert_array_equal(method._start[c][i].numpy(), model.x[i])
                np.testing.assert_array_equal(method._momentum[c][i].numpy(), model.m[i])
    run(spec, towers, init, moves, every=check)
    if warmup:
        assert np.abs(model.m[0]).max() > 0  # the warmup filled m (and x moved with v)
    if decay:  # the schedule mattered: the model with a constant 0.9 ends elsewhere
        plain = NumpyDiLoCo(init, towers, 2, 0.7, nesterov, lambda s: 0.9)
        for s in range(STEPS):
            for c in range(towers):
                for i in range(len(SHAPES)):
                    plain.v[c][i] = plain.v[c][i] + moves[s][c][i]
            plain.after_step(s)
        assert max(np.abs(a - b).max() for a, b in zip(plain.x, model.x)) > 1e-3


def test_off_and_constant_settings_are_the_plain_method_bit_for_bit():
    """The default (no decay) is today's diloco: its canonical spec names no new option (a
    run folder's settings compare equal), and a decay whose three values are all 0.9 gives
    the same parameters, x and m bit for bit as the plain method (the same float32 constant
    multiplies m: one picked by the step counter, or the option's)."""
    method, options = aggregation.parse("diloco:period=2")
    assert options_lib.format_spec(method, options) == "diloco:period=2"
    init, moves = progress(2)
    plain, plain_copies = run("diloco:period=2", 2, init, moves)
    same, same_copies = run("diloco:period=2,momentum_decay=8,decay_start=0.9,"
                            "decay_middle=0.9", 2, init, moves)
    assert_copies_equal(weights(same_copies), weights(plain_copies))
    for a, b in zip(state(same), state(plain)):
        np.testing.assert_array_equal(a, b)


def test_a_resume_mid_decay_equals_the_uninterrupted_run():
    """Stopped after step 5 (inside the decay's second half, D = 12) and resumed by a fresh
    method holding what a checkpoint restores (the copies, x, m, the step counter): the
    remaining steps give the uninterrupted run's bits: mu is a function of the counter."""
    spec = "diloco:period=2,momentum_decay=12"
    init, moves = progress(2)
    saved = {}

    def keep(s, method, copies):
        if s == 5:
            saved.update(copies=weights(copies), state=state(method))
    whole, whole_copies = run(spec, 2, init, moves, every=keep)
    fresh = method_on_copies(spec, 2, init)
    method, copies, _ = fresh
    for copy, held in zip(copies, saved["copies"]):
        for variable, value in zip(copy.trainable, held):
            variable.assign(value)
    for variable, value in zip(method.state_variables, saved["state"]):
        variable.assign(value)
    resumed, resumed_copies = run(spec, 2, init, moves, range(6, STEPS), fresh)
    assert_copies_equal(weights(resumed_copies), weights(whole_copies))
    for a, b in zip(state(resumed), state(whole)):
        np.testing.assert_array_equal(a, b)


PIER = ",momentum_warmup=2,momentum_decay=4"


@pytest.mark.parametrize("member, twin", [
    ("streaming_diloco:period=2,fragments=1", "diloco:period=2"),
    ("sparta_diloco:period=2,fraction=1", None),
    ("noloco:period=2,group=0,outer_lr=1,gamma=0.5", "diloco:period=2,outer_lr=1,nesterov=false"),
])
def test_every_member_takes_the_same_schedule(member, twin):
    """The options are the family's, with the same warmup and decay: streaming_diloco with
    one fragment is diloco bit for bit, noloco with one group of 2 is diloco:nesterov=false
    (v = -m, filled as v <- a v - b delta in the warmup) bit for bit; sparta_diloco ends
    elsewhere than without them."""
    init, moves = progress(2, warmup=2)
    steps = range(8)
    _, copies = run(member + PIER, 2, init, moves, steps)
    if twin:
        _, theirs = run(twin + PIER, 2, init, moves, steps)
        assert_copies_equal(weights(copies), weights(theirs))
        return
    _, plain = run(member, 2, init, moves, steps)
    assert max(np.abs(a - b).max() for a, b in zip(weights(copies)[0], weights(plain)[0])) > 1e-3


def test_the_warmup_averages_gradients_then_stops():
    """With momentum_warmup=4 each copy receives the ring's mean of the towers' gradients
    while s < 4 (synchronous training, the traffic's occasion "warmup") and its own after."""
    init, _ = progress(2)
    method, copies = method_on_copies("diloco:period=2,momentum_warmup=4", 2, init,
                                      step_fn=False)
    grads = [[tf.constant(np.full(shape, c + 1.0, F32)) for shape in SHAPES] for c in range(2)]
    with method.step():
        reduce = tf.function(lambda: method.reduce(grads, copies[0].trainable))
        for s, want in [(3, [1.5, 1.5]), (4, [1.0, 2.0])]:
            method.step_counter.assign(s)
            out = reduce()
            for c in range(2):
                for g in out[c]:
                    np.testing.assert_array_equal(g.numpy(), np.full(g.shape, want[c], F32))
    assert "warmup" in method.traffic.by_occasion


def test_refusals_are_one_line(tmp_path):
    """A decay longer than the run, a first half with no outer step, a value out of [0, 1),
    and the options given to a method without an outer momentum: one ConfigError line each."""
    for spec, steps, words in [
            ("diloco:period=2,momentum_decay=40", 20, "longer than the run"),
            ("streaming_diloco:period=8,fragments=2,momentum_decay=10", 100, ">= 16"),
            ("noloco:period=4,momentum_decay=6", 100, "no outer step"),
            ("diloco:period=4,momentum_warmup=20,momentum_decay=8", 24, "longer than the run"),
            ("sparta_diloco:period=4,momentum_warmup=6", 100, "not a multiple"),
            ("streaming_diloco:period=4,tau=1,momentum_warmup=8", 100, "tau or eager")]:
        with pytest.raises(ConfigError) as error:
            check_run(types.SimpleNamespace(aggregation=spec, node_failures=None), steps)
        assert "\n" not in str(error.value) and words in str(error.value)
    with pytest.raises(ConfigError) as error:
        check_run(types.SimpleNamespace(aggregation="diloco:period=2,momentum_warmup=2",
                                        node_failures="1@2-3"), 10)
    assert "\n" not in str(error.value) and "node_failures" in str(error.value)
    for spec, steps in [("diloco:period=2,momentum_decay=20", 20), ("sparseloco", 1),
                        ("diloco:period=2,momentum_warmup=10,momentum_decay=10", 20)]:
        check_run(types.SimpleNamespace(aggregation=spec, node_failures=None), steps)
    with pytest.raises(ConfigError) as error:  # the run's gate asks it (runs/config_checks.py)
        helpers.small_config(str(tmp_path), devices="cpu:2",
                             aggregation="diloco:period=2,momentum_decay=8").validated()
    assert "\n" not in str(error.value) and "--train_steps=5" in str(error.value)
    for spec, words in [("diloco:decay_start=1.0", "out of range"),
                        ("sparseloco:momentum_decay=8", "has no option 'momentum_decay'"),
                        ("localsgd:decay_middle=0.9", "has no option 'decay_middle'")]:
        with pytest.raises(ConfigError) as error:
            aggregation.parse(spec)
        assert "\n" not in str(error.value) and words in str(error.value)
