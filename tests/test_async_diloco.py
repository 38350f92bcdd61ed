"""async_diloco (mgloop/aggregation/local/async_diloco.py, async_clock.py, async_run.py): the
schedule of nodes of speeds 1, 1, 1/2, 1/4 by hand, a numpy model of the schedule and the
delayed Nesterov merges on hand-made inner progress, the degenerate setting against DiLoCo,
the bytes of a merge at --nodes=4 on the mlp, the guard's inner steps, resume, refusals."""

import fractions
import json

import numpy as np
import pytest

import mgloop
from mgloop import aggregation
from mgloop.aggregation.local import async_run
from mgloop.aggregation.local.async_clock import Clock
from mgloop.errors import ConfigError
from tests import helpers, tolerance
from tests.copies_by_hand import method_on_copies
from tests.test_local_steps import checkpoint_tensors

F32 = np.float32
SHAPES = [(3, 4), (4,), (5,)]  # 21 parameters
SPEEDS = (1, 1, 0.5, 0.25)  # the --node_speeds of nodes 1x, 1x, 2x and 4x slower


def test_schedule_by_hand():
    """H = 4: rounds 4, 4, 2, 1 with DyLU (4 each without). Nodes 0, 1 step every step,
    node 2 at odd steps, node 3 at steps 3, 7, ...; with DyLU all arrive at step 3 (in node
    order, each merged alone); without, node 2 arrives at 7, 15 and node 3 at 15; a quorum of
    3 merges nodes 0, 1, 2 at step 3 while node 3 waits (skipping its turn at 7) to be
    merged with 0, 1 at 7."""
    clock = Clock(SPEEDS, 4, 4, True, 1)
    assert clock.rounds == [4, 4, 2, 1]
    stepped = [clock.events(s)[0] for s in range(8)]
    assert [s for s in range(8) if stepped[s][2]] == [1, 3, 5, 7]
    assert [s for s in range(8) if stepped[s][3]] == [3, 7]
    assert all(stepped[s][0] and stepped[s][1] for s in range(8))
    merges = {s: clock.events(s)[2] for s in range(12) if clock.events(s)[2]}
    assert merges == {s: [(0,), (1,), (2,), (3,)] for s in (3, 7, 11)}
    plain = Clock(SPEEDS, 4, 4, False, 1)
    assert plain.rounds == [4] * 4
    assert {s: plain.events(s)[2] for s in range(16) if plain.events(s)[2]} == {
        3: [(0,), (1,)], 7: [(0,), (1,), (2,)], 11: [(0,), (1,)], 15: [(0,), (1,), (2,), (3,)]}
    quorum = Clock(SPEEDS, 4, 4, True, 3)
    assert {s: quorum.events(s)[2] for s in range(12) if quorum.events(s)[2]} == {
        3: [(0, 1, 2)], 7: [(3, 0, 1)], 11: [(2, 0, 1)]}
    assert not quorum.events(7)[0][3]  # waiting: no inner step on its turn
    assert quorum.events(11)[1] == (True, True, False, True)  # node 3 pending at 11
    # quorum 2 with a grace window of 2 steps, rounds of 4: nodes 0, 1 arrive at 3 and wait
    # to 5 for more; node 2 (at 7) is merged with their next arrivals (9) at 11; node 3 (at
    # 15) with theirs (15) at 17; with DyLU every node arrives together: one merge of all.
    grace = Clock(SPEEDS, 4, 4, False, 2, 2)
    assert {s: grace.events(s)[2] for s in range(20) if grace.events(s)[2]} == {
        5: [(0, 1)], 11: [(2, 0, 1)], 17: [(0, 1, 3)]}
    assert not any(grace.events(4)[0][:2]) and all(grace.events(6)[0][:2])
    aligned = Clock(SPEEDS, 4, 4, True, 2, 2)
    assert {s: aligned.events(s)[2] for s in range(8) if aligned.events(s)[2]} == {
        3: [(0, 1, 2, 3)], 7: [(0, 1, 2, 3)]}


class NumpyAsync:
    """The schedule (turns from exact fractions, rounds, arrivals in node order, a quorum
    with waiting and a grace window) and the delayed Nesterov merges in float32 numpy, in the
    module's order."""

    def __init__(self, init, speeds, period, lr, beta, delay, c, quorum, grace=0,
                 dynamic=True):
        n = len(speeds)
        rates = [fractions.Fraction(str(s)) / max(fractions.Fraction(str(v)) for v in speeds)
                 for s in speeds]
        self.rates, self.rounds = rates, [max(1, -(-period * r.numerator // r.denominator))
                                          if dynamic else period for r in rates]
        self.grace, self.reached = grace, 0
        self.lr, self.beta, self.delay, self.c, self.quorum = lr, beta, delay, c, quorum or n
        self.x = [w.copy() for w in init]
        self.m = [np.zeros_like(w) for w in init]
        self.b = [np.zeros_like(w) for w in init]
        self.theta = [[w.copy() for w in init] for _ in range(n)]
        self.start = [[w.copy() for w in init] for _ in range(n)]
        self.done, self.waiting, self.version_at = [0] * n, [False] * n, [0] * n
        self.pending, self.tokens, self.merges, self.staleness = None, 0, 0, []

    def stepping(self, s):
        return [((s + 1) * r.numerator // r.denominator > s * r.numerator // r.denominator)
                and not self.waiting[i] for i, r in enumerate(self.rates)]

    def after_update(self, s, stepped):
        for i in range(len(self.theta)):
            self.done[i] += stepped[i]
        for i in range(len(self.theta)):
            if not (stepped[i] and self.done[i] == self.rounds[i]):
                continue
            delta = [a - t for a, t in zip(self.start[i], self.theta[i])]
            if self.quorum == 1 and not self.grace:
                self.outer_step(delta)
                self.restart(i)
                continue
            w = F32(self.rounds[i])
            self.pending = ([w * d for d in delta] if self.pending is None
                            else [p + w * d for p, d in zip(self.pending, delta)])
            self.tokens += self.rounds[i]
            self.waiting[i] = True
            if sum(self.waiting) == self.quorum:
                self.reached = s
            if sum(self.waiting) == len(self.theta) or (
                    sum(self.waiting) >= self.quorum and not self.grace):
                self.merge()
        if self.grace and sum(self.waiting) >= self.quorum and s >= self.reached + self.grace:
            self.merge()

    def merge(self):
        self.outer_step([p / F32(self.tokens) for p in self.pending])
        self.pending, self.tokens = None, 0
        for j in range(len(self.theta)):
            if self.waiting[j]:
                self.restart(j)

    def outer_step(self, delta):
        n, c, beta = self.delay, self.c, F32(self.beta)
        flush = (self.merges + 1) % n == 0
        coefficient = F32((1.0 - c * n + c) * self.beta if flush else c * self.beta)
        for v, d in enumerate(delta):
            self.b[v] = self.b[v] + d
            if flush:
                self.m[v] = beta * self.m[v] + self.b[v] / F32(n)
            self.x[v] = self.x[v] - F32(self.lr) * (coefficient * self.m[v] + d / F32(n))
            if flush:
                self.b[v] = np.zeros_like(self.b[v])
        self.merges += 1

    def restart(self, j):
        self.staleness.append((j, self.merges - 1 - self.version_at[j]))
        self.version_at[j], self.done[j], self.waiting[j] = self.merges, 0, False
        self.start[j] = [w.copy() for w in self.x]
        self.theta[j] = [w.copy() for w in self.x]


def method_on_hand(spec, speeds, init, nodes=4):
    return method_on_copies(spec, nodes, init, node_speeds=speeds)


def drive(method, copies, after_update, model, steps, rng, bound=0.0):
    """`steps` steps of hand-made inner progress on the nodes the model says step; after
    each, every node's theta and x_start, and x, m, b within `bound` of the model's."""
    for s in range(steps):
        stepped = model.stepping(s)
        for i, copy in enumerate(copies):
            if stepped[i]:
                for v, variable in enumerate(copy.trainable):
                    model.theta[i][v] = model.theta[i][v] + F32(0.1) * rng.standard_normal(
                        SHAPES[v]).astype(F32)
                    variable.assign(model.theta[i][v])
        method.step_counter.assign(s)
        after_update()
        model.after_update(s, stepped)
        pairs = [([c.trainable for c in copies], model.theta), (method._start, model.start),
                 ([method._x, method._m, method._b], [model.x, model.m, model.b])]
        for got, want in pairs:
            for a, b in zip(got, want):
                for x, y in zip(a, b):
                    np.testing.assert_allclose(np.asarray(x.numpy()), y, rtol=0, atol=bound)


@pytest.mark.parametrize("quorum, grace, dynamic", [(1, 0, True), (3, 0, True),
                                                   (2, 2, False)])
def test_equals_numpy_model_at_speeds_1_1_2_4_slower(quorum, grace, dynamic):
    """20 steps of hand-made progress at H = 4, N = 2, c = 0.25; quorum 1, 3, and 2 with a
    grace window of 2 (rounds of 4): every node's theta and x_start, x, m and b equal the
    model's bit for bit (element-wise float32 operations in the same order: nothing to
    reassociate), and so do the staleness of each merge and the traced bytes."""
    spec = (f"async_diloco:period=4,delay=2,activation=0.25,quorum={quorum},outer_lr=0.6,"
            f"outer_momentum=0.8,grace={grace},dynamic={str(dynamic).lower()}")
    rng = np.random.default_rng(5)
    init = [rng.standard_normal(shape).astype(F32) for shape in SHAPES]
    method, copies, after_update = method_on_hand(spec, SPEEDS, init)
    for i in range(4):  # per merge: Delta_i up and x down, 21 float32 each, one message
        up = method.traffic.of_occasion(f"async up, node {i}")
        down = method.traffic.of_occasion(f"async down, node {i}")
        assert (sum(up.sent.values()), sum(up.received.values())) == (84, 0)
        assert (sum(down.received.values()), sum(down.sent.values())) == (84, 0)
    model = NumpyAsync(init, SPEEDS, 4, 0.6, 0.8, 2, 0.25, quorum, grace, dynamic)
    drive(method, copies, after_update, model, 20, rng)
    assert model.merges == int(method._merges.numpy()) >= 3
    last = {}
    for j, stale in model.staleness:
        last[j] = stale
    assert [int(v.numpy()) for v in method._last_staleness] == [last[j] for j in range(4)]
    assert int(method._stale_sum.numpy()) == sum(s for _, s in model.staleness)
    if grace:  # test_schedule_by_hand's merges (0, 1), (2, 0, 1), (0, 1, 3), restarted in
        # node order: node 2 started before merge 0, node 3 before merges 0 and 1
        assert model.staleness == [(0, 0), (1, 0), (0, 0), (1, 0), (2, 1), (0, 0), (1, 0),
                                   (3, 2)]
    if quorum == 1:  # DyLU: all four arrive together, taken in node order: 0, 1, 2, 3 stale
        assert model.staleness[:4] == [(0, 0), (1, 1), (2, 2), (3, 3)]
        assert {s for _, s in model.staleness[4:]} == {3}


def test_equal_speeds_every_node_delay_1_is_diloco():
    """Equal speeds, quorum 0 (every node), delay 1: DiLoCo (Nesterov) on the same hand-made
    progress at 4 nodes, H = 2, 6 outer steps. They differ only in the mean: DiLoCo's
    x - ring mean of theta, here the token-weighted mean of x - theta_j; each forms
    delta from at most N + 2 roundings of terms no larger than M (the largest |x|, |theta|,
    |m|), 2 gamma(N + 2) 2 M apart, and a difference carried into the next outer step is
    scaled by at most (1 + beta)(1 + lr) + 1 < 5 (x, m and the next theta linear in it)."""
    rng = np.random.default_rng(8)
    init = [rng.standard_normal(shape).astype(F32) for shape in SHAPES]
    mine, my_copies, my_step = method_on_hand(
        "async_diloco:period=2,quorum=0,delay=1,outer_lr=0.7,outer_momentum=0.9", (), init)
    theirs, their_copies, their_step = _diloco(init)
    worst = 0.0
    for s in range(12):
        for v in range(len(SHAPES)):
            noise = [F32(0.1) * rng.standard_normal(SHAPES[v]).astype(F32) for _ in range(4)]
            for copies in (my_copies, their_copies):
                for c, copy in enumerate(copies):
                    copy.trainable[v].assign(copy.trainable[v].numpy() + noise[c])
        for method, step in ((mine, my_step), (theirs, their_step)):
            method.step_counter.assign(s)
            step()
        magnitude = max(float(np.abs(w.numpy()).max()) for w in
                        mine._x + mine._m + [v for c in my_copies for v in c.trainable])
        outer = (s + 1) // 2
        bound = sum(2 * tolerance.gamma(6) * 2 * magnitude * 5 ** k for k in range(outer))
        for x, y in zip(mine._x, theirs._start[0]):
            gap = float(np.abs(x.numpy() - y.numpy()).max())
            worst = max(worst, gap)
            assert gap <= bound
        for x, y in zip(mine._m, theirs._momentum[0]):
            assert float(np.abs(x.numpy() - y.numpy()).max()) <= bound
    print(f"largest |x_async - x_diloco| over 6 outer steps: {worst:.3g} (bound {bound:.3g})")


def _diloco(init):
    return method_on_copies("diloco:period=2", 4, init)


def test_four_nodes_bytes_guard_and_model(tmp_path):
    """--nodes=4 at speeds 1, 1, 1/2, 1/4, H = 4, 8 steps on the mlp of two hidden layers (42,506 parameters): each
    merge moves, per node, its pseudo-gradient up and x down, 42,506 float32 = 170,024 B,
    one message each, on its own occasion, twice (steps 3 and 7); the guard gave the nodes
    8, 8, 4 and 2 inner steps (their optimizers' step counts), every node's rate read at the
    run's step (step/hooks/inner_turns.py); the model evaluated is x."""
    config = helpers.small_config(str(tmp_path), devices="cpu:4", nodes=4, mlp_depth=2,
                                  node_speeds="1,1,0.5,0.25", train_steps=8, steps_per_loop=4,
                                  warmup_steps=8, aggregation="async_diloco:period=4")
    result = mgloop.run(config)
    with open(tmp_path / "summary.json") as handle:
        summary = json.load(handle)
    assert summary["evaluated_model"] == "outer parameters x (syncer)"
    syncs = summary["link_model"]["syncs"]
    for i in range(4):
        for way in ("up", "down"):
            sync = syncs[f"async {way}, node {i}"]
            assert (sync["bytes_per_device"], sync["messages_per_device"],
                    sync["occurrences"]) == (42506 * 4, 1, 2)
    trainer = result.trainer
    assert [int(c.optimizer.iterations.numpy()) for c in trainer.copies] == [8, 8, 4, 2]
    # every node's rate is the schedule at the run's step s, not at its own count (a warmup
    # of 8 steps: 0.1 (s + 1) / 8; at their own counts nodes 2 and 3 would read 0.0625, 0.0375)
    for step in (8, 5):
        trainer.global_step.assign(step)
        rates = [float(c.optimizer.learning_rate) for c in trainer.copies]
        np.testing.assert_allclose(rates, [0.1 * min(step + 1, 8) / 8] * 4, rtol=1e-6)
    method = trainer.aggregation.inner
    assert summary["async_staleness"] == method.staleness() == {
        "merges": 8, "staleness_sum": 6 + 12, "staleness_max": 3, "last_staleness": [3, 3, 3, 3]}
    assert async_run.scalars(trainer.aggregation) == {
        "async/merges": 8.0, "async/staleness_max": 3.0, "async/staleness_mean": 18 / 8}
    assert "paced by the fastest node" in summary["link_model"]["compute_source"]
    produced = np.concatenate([w.ravel() for w in result.model.get_weights()])
    x = np.concatenate([v.numpy().ravel() for v in method._x])
    np.testing.assert_array_equal(produced, x)


def test_resume_equals_an_uninterrupted_run(tmp_path):
    """8 steps straight equal 5 (a checkpoint mid-round: node 3 waiting under quorum 3) then
    3 more resumed, bit for bit: every tensor of the last checkpoint."""
    def run(name, steps):
        return mgloop.run(helpers.small_config(
            str(tmp_path / name), devices="cpu:4", nodes=4, node_speeds="1,1,0.5,0.25",
            aggregation="async_diloco:period=4,quorum=3", train_steps=steps,
            steps_per_loop=1, checkpoint_every=0, eval_every=0))
    run("straight", 8)
    run("resumed", 5)
    assert run("resumed", 8)["start_step"] == 5
    straight, resumed = (checkpoint_tensors(tmp_path / n) for n in ("straight", "resumed"))
    assert straight.keys() == resumed.keys()
    assert any("async_x" in key or "async" in key for key in straight)
    for key, value in straight.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)


@pytest.mark.parametrize("settings, words", [
    (dict(devices="cpu:4", nodes=4, aggregation="async_diloco", node_failures="1@2-3"),
     "node_failures"),
    (dict(devices="cpu:2", aggregation="async_diloco", node_speeds="1"),
     "needs the method at the nodes"),
    (dict(devices="cpu:4", nodes=4, aggregation="async_diloco", node_speeds="1,1"),
     "gives 2 speeds for 4 nodes"),
    (dict(devices="cpu:4", nodes=4, aggregation="async_diloco:quorum=5"), "at most the nodes"),
    (dict(devices="cpu:4", nodes=4, aggregation="async_diloco:delay=2,activation=0.6"),
     "[0, 1/N]")])
def test_refusals_are_one_line(tmp_path, settings, words):
    with pytest.raises(ConfigError) as error:
        helpers.small_config(str(tmp_path), **settings).validated()
    assert "\n" not in str(error.value) and words in str(error.value)
    assert aggregation.get("async_diloco").capabilities.resize_refusal
    assert not aggregation.get("async_diloco").capabilities.runs_between_processes
