"""`streaming_diloco` (aggregation/local/streaming_diloco.py): fragments, their staggered outer
steps, the quantised outer gradients, against a numpy model of the method; equal to
`diloco` with one fragment; its refusals. Its identity options are checked against one
device by the contract test (tests/test_contract.py).
"""

import numpy as np
import pytest
import tensorflow as tf

from mgloop.aggregation.local.streaming_diloco import offsets, partition
from mgloop.errors import ConfigError
from mgloop.observe import link_model, link_report
from mgloop.training import variables
from tests import helpers
from tests.copies_by_hand import (assert_copies_equal, inner_steps_by_hand, method_on_copies,
                                  trained_side_by_side)

F32 = np.float32


@pytest.mark.parametrize("sizes, fragments, want", [
    ([12, 4, 6, 5, 6], 3, [[0], [1, 2], [3, 4]]),  # C* = 12
    ([1] * 8, 3, [[0, 1, 2], [3, 4, 5], [6, 7]]),  # C* = 3, filled greedily
    ([5, 1, 1, 1, 1, 5], 3, [[0], [1, 2, 3, 4], [5]]),  # C* = 5
    ([24576, 128, 16384, 128, 1280, 10], 4, [[0], [1, 2, 3], [4], [5]]),  # the mlp: the
    # last groups take one variable each once as many remain as groups are to open
    ([7], 1, [[0]]),
])
def test_partition_by_hand(sizes, fragments, want):
    assert partition(sizes, fragments) == want


def test_offsets_by_hand():
    assert offsets(16, 4) == [4, 8, 12, 16]
    assert offsets(5, 3) == [1, 3, 5]  # floor((p+1) 5 / 3)
    assert offsets(6, 3) == [2, 4, 6]
    assert offsets(1, 1) == [1]


E3M0_MIDPOINTS = [F32(2.0 ** -7)] + [F32(3 * 2.0 ** e) for e in range(-7, -1)]


def e3m0_integers(d, peak):
    """The E3M0 codes of d against the scale `peak` as z = sign 2^(k-1) (int64): k counts
    the midpoints A c_j that |d| exceeds (ties to the smaller magnitude)."""
    k = sum((np.abs(d) > F32(peak) * c).astype(np.int64) for c in E3M0_MIDPOINTS)
    return np.where(k > 0, 2 ** np.maximum(k - 1, 0), 0) * np.where(d < 0, -1, 1)


class NumpyStreamingDiLoCo:
    """The method in numpy float32, op for op: T copies v[c][i], each with its x[c][i],
    m[c][i] (equal on every copy but with eager) and eager's r[c][i], the fragments and
    schedule given by hand."""

    def __init__(self, init, towers, fragments, schedule, period, lr, mu, nesterov, bits,
                 tau=0, alpha=0.5, fmt="int", eager=False):
        self.v = [[w.copy() for w in init] for _ in range(towers)]
        self.x = [[w.copy() for w in init] for _ in range(towers)]
        self.m = [[np.zeros_like(w) for w in init] for _ in range(towers)]
        self.r = [[np.zeros_like(w) for w in init] for _ in range(towers)]
        self.towers, self.fragments = towers, fragments
        self.schedule, self.period = schedule, period
        self.lr, self.mu, self.nesterov, self.bits = F32(lr), F32(mu), nesterov, bits
        self.tau, self.alpha, self.fmt, self.eager = tau, F32(alpha), fmt, eager

    def after_step(self, s):
        for fragment, offset in zip(self.fragments, self.schedule):
            if (s + 1) % self.period == offset % self.period:
                self.outer(fragment)
            late = s + 1 - self.tau
            if self.tau and late >= offset and late % self.period == offset % self.period:
                for c in range(self.towers):  # the merge, tau steps after the send
                    for i in fragment:
                        self.v[c][i] = (self.alpha * self.v[c][i]
                                        + F32(1.0 - self.alpha) * self.x[c][i])

    def mean_delta(self, fragment):
        """(1/T) sum_c Q(delta_c) per copy (the same on every copy)."""
        deltas = [[self.x[c][i] - self.v[c][i] for i in fragment] for c in range(self.towers)]
        if self.fmt == "int" and self.bits == 0:  # the ring's mean, of two copies
            assert self.towers == 2
            return [(a + b) * F32(0.5) for a, b in zip(*deltas)]
        peak = F32(max(np.abs(d).max() for per_copy in deltas for d in per_copy))
        out = []
        if self.fmt == "e3m0":
            for k in range(len(fragment)):
                total = sum(e3m0_integers(deltas[c][k], peak) for c in range(self.towers))
                out.append(total.astype(F32) * (peak * F32(2.0 ** -6) * F32(1.0 / self.towers)))
            return out
        levels = 2 ** (self.bits - 1) - 1
        scale = peak * F32(1.0 / levels)
        for k in range(len(fragment)):
            total = np.zeros(deltas[0][k].shape, np.int64)
            for c in range(self.towers):
                codes = (np.clip(np.rint(deltas[c][k] / scale), -levels, levels)
                         if scale > 0 else np.zeros_like(deltas[c][k]))
                total += codes.astype(np.int64)
            out.append(total.astype(F32) * (scale * F32(1.0 / self.towers)))
        return out

    def outer(self, fragment):
        if self.fmt == "int" and self.bits == 0 and not self.eager:  # x - mean(v): diloco's
            mean = [(self.v[0][i] + self.v[1][i]) * F32(0.5) for i in fragment]
            per_copy = [[self.x[c][i] - a for i, a in zip(fragment, mean)]
                        for c in range(self.towers)]
        else:
            means = self.mean_delta(fragment)
            per_copy = [means] * self.towers
        if self.eager:
            share = F32(1.0 / self.towers)
            fresh = [[(self.x[c][i] - self.v[c][i]) * share for i in fragment]
                     for c in range(self.towers)]
            gradients = [[o + self.r[c][i] for o, i in zip(fresh[c], fragment)]
                         for c in range(self.towers)]
            for c in range(self.towers):
                for o, mean, i in zip(fresh[c], per_copy[c], fragment):
                    self.r[c][i] = mean - o
            per_copy = gradients
        for c in range(self.towers):
            for i, delta in zip(fragment, per_copy[c]):
                self.m[c][i] = self.mu * self.m[c][i] + delta
                step = delta + self.mu * self.m[c][i] if self.nesterov else self.m[c][i]
                self.x[c][i] = self.x[c][i] - self.lr * step
                if not self.tau:
                    self.v[c][i] = self.x[c][i].copy()


SHAPES = [(3, 4), (4,), (2, 3), (5,), (6,)]  # 12, 4, 6, 5, 6 elements
FRAGMENTS = [[0], [1, 2], [3, 4]]  # by hand: C* = 12


def fragment_bytes(towers, fragment, fmt, bits):
    """What one fragment's exchange sends, summed over the T copies, by hand: the float32
    ring 2(T-1)/T 4 n per copy; quantised, the scales' ring (2(T-1) chunks of 4 bytes per
    copy) and the int8 codes' ring 2(T-1)/T n, or the E3M0 codes gathered, (T-1)
    ceil(n/2) per copy."""
    n = sum(int(np.prod(SHAPES[i])) for i in fragment)
    if fmt == "int" and bits == 0:
        return 2 * (towers - 1) * 4 * n
    scales = towers * 2 * (towers - 1) * 4
    if fmt == "e3m0":
        return scales + towers * (towers - 1) * ((n + 1) // 2)
    return scales + 2 * (towers - 1) * n


@pytest.mark.parametrize("towers, period, options", [
    (2, 5, dict(bits=0, nesterov=True)),  # offsets 1, 3, 5: H not divisible by P
    (2, 6, dict(bits=0, nesterov=False)),
    (3, 6, dict(bits=4, nesterov=True)),  # quantised: integer code sums, exact in any order
    (4, 5, dict(bits=2, nesterov=True)),  # ternary codes
    (3, 6, dict(bits=0, nesterov=True, fmt="e3m0")),  # 4-bit floats, gathered
    (2, 5, dict(bits=0, nesterov=True, tau=2, alpha=0.25)),  # overlap: merged 2 steps on
    (4, 6, dict(bits=0, nesterov=True, tau=5, fmt="e3m0")),  # flights of fragments overlap
    (3, 5, dict(bits=4, nesterov=False, tau=1)),
    (2, 6, dict(bits=0, nesterov=True, eager=True)),  # eager: the float ring of the deltas
    (3, 5, dict(bits=0, nesterov=True, eager=True, fmt="e3m0")),
    (4, 6, dict(bits=3, nesterov=False, eager=True)),
])
def test_equals_numpy_model(towers, period, options):
    """Hand-made inner progress (each copy's parameters moved by its own seeded noise each
    step, the same float32 values given to both), 13 steps, 3 fragments: after every step
    every copy's parameters, x, m (and eager's r) equal the numpy model's bit for bit (the
    same float32 element-wise ops; the float means are of 2 copies, the quantised ones
    integer sums). The traced traffic is every fragment's exchange once, against the hand
    count (`fragment_bytes`), each on its occasion, which says how many steps of compute
    it may overlap: tau, or the period with eager."""
    bits, nesterov = options["bits"], options["nesterov"]
    tau, alpha = options.get("tau", 0), options.get("alpha", 0.5)
    fmt, eager = options.get("fmt", "int"), options.get("eager", False)
    spec = (f"streaming_diloco:period={period},fragments=3,outer_lr=0.7,outer_momentum=0.9,"
            f"nesterov={nesterov},outer_bits={bits},outer_format={fmt},tau={tau},"
            f"alpha={alpha},eager={eager}")
    rng = np.random.default_rng(5)
    init = [rng.standard_normal(shape).astype(F32) for shape in SHAPES]
    method, copies = method_on_copies(spec, towers, init, step_fn=False)
    assert method.fragments == FRAGMENTS
    schedule = [period // 3, 2 * period // 3, period]
    assert method.offsets == schedule
    model = NumpyStreamingDiLoCo(init, towers, FRAGMENTS, schedule, period, 0.7, 0.9,
                                 nesterov, bits, tau, alpha, fmt, eager)
    with method.step():
        after_update = tf.function(lambda: method.after_update(copies)).get_concrete_function()
    for p, fragment in enumerate(FRAGMENTS):
        occasion, traffic = method.traffic.by_occasion[f"fragment {p}"]
        assert sum(traffic.sent.values()) == fragment_bytes(towers, fragment, fmt, bits)
        assert occasion.overlap_steps == (period if eager else tau)
    assert sum(method.traffic.sent.values()) == sum(
        fragment_bytes(towers, fragment, fmt, bits) for fragment in FRAGMENTS)
    synced = 0
    for s in range(13):
        inner_steps_by_hand(model.v, copies, rng, SHAPES)
        method.step_counter.assign(s)
        after_update()
        before = [w.copy() for w in model.x[0]]
        model.after_step(s)
        synced += any(not np.array_equal(a, b) for a, b in zip(before, model.x[0]))
        for c, copy in enumerate(copies):
            for i, variable in enumerate(copy.trainable):
                np.testing.assert_array_equal(variable.numpy(), model.v[c][i],
                                              err_msg=f"step {s} copy {c} variable {i}")
            for i in range(len(SHAPES)):
                np.testing.assert_array_equal(method._start[c][i].numpy(), model.x[c][i])
                np.testing.assert_array_equal(method._momentum[c][i].numpy(), model.m[c][i])
                if eager:
                    np.testing.assert_array_equal(method._pending[c][i].numpy(), model.r[c][i])
    assert synced == sum(1 for s in range(13) for o in schedule if (s + 1) % period == o % period)
    assert synced >= 6  # every fragment at least twice: the momentum takes part
    copies_apart = [np.abs(model.v[0][i] - model.v[1][i]).max() for i in range(len(SHAPES))]
    assert max(copies_apart) > 0.01  # the copies differ between syncs
    if eager:  # each copy's own fresh share: the outer parameters differ per copy
        assert any(not np.array_equal(model.x[0][i], model.x[1][i]) for i in range(5))


def test_quantised_mean_is_within_half_a_step_of_the_exact_mean():
    """outer_bits=4 on 3 copies, one sync: the averaged outer gradient lies within
    s/2 = A/(2L) (L = 7) of the exact mean of the copies' deltas, up to float32's
    roundings (a few u of A), and is not the exact mean (the codes are coarse)."""
    rng = np.random.default_rng(1)
    init = [rng.standard_normal(shape).astype(F32) for shape in SHAPES]
    moved = [[w + rng.standard_normal(w.shape).astype(F32) for w in init] for _ in range(3)]
    method, copies = method_on_copies("streaming_diloco:period=1,fragments=1,outer_bits=4", 3,
                                      init, moved, step_fn=False)
    got = [d.numpy() for d in method.outer_gradients(copies, [0, 1, 2, 3, 4])[0]]
    exact = [np.mean([init[i].astype(np.float64) - m[i] for m in moved], axis=0)
             for i in range(len(SHAPES))]
    peak = max(np.abs(init[i] - m[i]).max() for m in moved for i in range(len(SHAPES)))
    worst = max(np.abs(g - e).max() for g, e in zip(got, exact))
    assert worst <= peak / 14 * (1 + 1e-6) + 8 * 2.0 ** -24 * peak
    assert worst > peak / 1000


@pytest.mark.parametrize("towers", [2, 4])
def test_one_fragment_unquantised_is_diloco_bit_for_bit(towers, tmp_path):
    """fragments=1, outer_bits=0 does `diloco`'s ops in its order (one ring of every
    variable, the same outer step): 4 steps of period 2 (2 outer steps) give every copy,
    its optimizer, x and m bit for bit."""
    (diloco, want), (streaming, got) = trained_side_by_side(
        tmp_path, ("diloco:period=2", "streaming_diloco:period=2,fragments=1,outer_bits=0"),
        towers, 4)
    assert_copies_equal(got, want)
    assert len(streaming.aggregation.state_variables) == len(diloco.aggregation.state_variables)
    for a, b in zip(streaming.aggregation.state_variables, diloco.aggregation.state_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for sc, dc in zip(streaming.copies, diloco.copies):
        for a, b in zip(sc.optimizer.variables, dc.optimizer.variables):
            np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_training_with_fragments_and_quantisation_moves_and_stays_finite(tmp_path):
    """The default-ish spec on 2 towers, 6 steps with syncs of all 3 fragments (period 3):
    finite, and the copies equal right after the last fragment's sync only on its
    variables."""
    config = helpers.small_config(str(tmp_path), devices="cpu:2",
                                  aggregation="streaming_diloco:period=3,fragments=3,"
                                              "outer_bits=4")
    trainer = helpers.build_trainer(config)
    start = helpers.copy_weights(trainer)[0]
    helpers.run_batches(trainer, helpers.batches(6))  # last step s = 5: fragment 2 syncs
    first, second = helpers.copy_weights(trainer)
    fragments = trainer.aggregation.fragments
    assert all(np.isfinite(w).all() for w in first + second)
    assert any(np.abs(w - w0).max() > 1e-3 for w, w0 in zip(first, start))
    for p, fragment in enumerate(fragments):
        for i in fragment:
            assert np.array_equal(first[i], second[i]) == (p == 2), (p, i)


def test_between_nodes_one_copy_per_node(tmp_path):
    """2 nodes of 2 towers, period 2, 2 fragments, 4-bit outer gradients (the float path
    shares the hand-over) (fragment 0 syncs after steps 0 and 2,
    fragment 1 after step 1): inside a node the copies are equal bit for bit after every
    step (the leader's outer step handed to the other tower at each fragment's sync);
    between the nodes exactly the synced fragment's variables are equal."""
    config = helpers.small_config(
        str(tmp_path), devices="cpu:4", nodes=2, optimizer="sgd",
        aggregation="streaming_diloco:period=2,fragments=2,outer_bits=4")
    trainer = helpers.build_trainer(config)
    fragments = trainer.aggregation.inner.fragments
    for s, batch in enumerate(helpers.batches(3)):
        helpers.run_batches(trainer, [batch])
        copies = helpers.copy_weights(trainer)
        for a, b in ((0, 1), (2, 3)):
            for x, y in zip(copies[a], copies[b]):
                np.testing.assert_array_equal(x, y, err_msg=f"step {s}")
        synced = 0 if s % 2 == 0 else 1
        for p, fragment in enumerate(fragments):
            for i in fragment:
                assert np.array_equal(copies[0][i], copies[2][i]) == (p == synced), (s, p, i)


@pytest.mark.parametrize("spec, message", [
    ("streaming_diloco:period=2,fragments=3",
     r"^--aggregation=streaming_diloco:period=2,fragments=3: fragments must be <= period"),
    ("streaming_diloco:outer_bits=1",
     r"^--aggregation=streaming_diloco:outer_bits=1: streaming_diloco option outer_bits=1 is "
     r"out of range: must be one of 0\|2\|3\|4\|5\|6\|7\|8$"),
    ("streaming_diloco:fragments=0", r"option fragments=0 is out of range: must be >= 1$"),
    ("streaming_diloco:period=4,fragments=2,tau=4",
     r"^--aggregation=streaming_diloco:period=4,tau=4: tau must be < period \(a fragment's "
     r"outer step is merged before the fragment is sent again\)$"),
    ("streaming_diloco:tau=1,eager=true",
     r"^--aggregation=streaming_diloco:eager=true,tau=1: eager updates overlap a whole "
     r"period themselves; use tau=0 with eager=true$"),
    ("streaming_diloco:outer_format=e3m0,outer_bits=4",
     r"^--aggregation=streaming_diloco:outer_format=e3m0,outer_bits=4: outer_bits sets the "
     r"int format only \(e3m0 has 4 bits\); use outer_bits=0 with outer_format=e3m0$"),
    ("streaming_diloco:outer_format=fp4", r"option outer_format='?fp4'? is out of range: must "
                                          r"be one of int\|e3m0$"),
    ("streaming_diloco:tau=1,alpha=1.5", r"option alpha=1.5 is out of range"),
])
def test_bad_options_refused_in_one_line(spec, message, tmp_path):
    """Refused by Config.validated(), before any device or variable exists."""
    with pytest.raises(ConfigError, match=message) as error:
        helpers.small_config(str(tmp_path), devices="cpu:2", aggregation=spec).validated()
    assert "\n" not in str(error.value)


def test_more_fragments_than_variables_refused_in_one_line(tmp_path, monkeypatch):
    """The mlp has 4 trainable variables: 5 fragments are refused once the template model
    is built (the count is known only then), before any copy of it, naming the option, the
    count and what would run."""
    def refuse(*args, **kwargs):
        raise AssertionError("variable copies were made before the fragments were checked")
    monkeypatch.setattr(variables, "make_copies", refuse)
    config = helpers.small_config(str(tmp_path), devices="cpu:2",
                                  aggregation="streaming_diloco:period=16,fragments=5")
    with pytest.raises(ConfigError, match=r"^--aggregation=streaming_diloco:fragments=5 needs "
                                          r"at least 5 trainable variables \(a fragment holds "
                                          r"whole variables\); the model has 4: use "
                                          r"fragments <= 4$") as error:
        helpers.build_trainer(config)
    assert "\n" not in str(error.value)


def test_per_step_bytes_and_modelled_step_against_diloco(tmp_path):
    """2 nodes of 2 towers, period 4, over 8 steps, the link report (observe/link_report.py)
    of each method's traffic with the same compute C: DiLoCo sends every parameter once
    per period (the gradient ratio between nodes is 4: a dense ring between 2 nodes moves
    the gradients' bytes), Streaming DiLoCo with 2 fragments the same bytes per step, each
    fragment on its own step, so its slowest step sends about half and its modelled step
    with overlap is not slower; without overlap it differs only by the latency of its
    extra messages (a ring per fragment)."""
    links = [link_model.parse("within:100gbit,2us"), link_model.parse("between:1gbit,50us")]
    compute, reports = 1e-3, {}
    for spec in ("diloco:period=4", "streaming_diloco:period=4,fragments=2,outer_bits=0"):
        config = helpers.small_config(str(tmp_path / spec.split(":")[0]), devices="cpu:4",
                                      nodes=2, aggregation=spec, mlp_depth=2)
        trainer = helpers.build_trainer(config)
        helpers.trace_batches(trainer, helpers.batches(1))  # the trace counts the traffic
        reports[spec.split(":")[0]] = link_report.report(
            link_report.Schedule(trainer.aggregation.traffic, 8), links, compute,
            gradient_bytes=link_report.gradient_bytes_of(trainer), num_nodes=2)
    diloco, streaming = reports["diloco"], reports["streaming_diloco"]
    assert diloco["compression_ratio"] == pytest.approx(4.0, rel=1e-12)
    assert diloco["syncs"]["sync"]["occurrences"] == 2
    assert diloco["syncs"]["sync"]["compression_ratio"] == pytest.approx(1.0, rel=1e-12)
    assert [streaming["syncs"][f"fragment {p}"]["occurrences"] for p in (0, 1)] == [2, 2]
    # the same bytes per step, but for the ring's split of each fragment (< 4 B per chunk)
    assert abs(streaming["gradient_bytes_per_step"] - diloco["gradient_bytes_per_step"]) <= 8
    slow, fast = diloco["links"]["between_1gbit_50us"], streaming["links"]["between_1gbit_50us"]
    assert fast["exchange_seconds_slowest_step"] < 0.75 * slow["exchange_seconds_slowest_step"]
    assert fast["step_seconds_overlap"] <= slow["step_seconds_overlap"]
    extra = (streaming["tiers"]["between"]["gradient"]["messages_per_device"]
             - diloco["tiers"]["between"]["gradient"]["messages_per_device"])
    assert extra > 0
    assert fast["step_seconds_no_overlap"] <= (slow["step_seconds_no_overlap"]
                                               + extra * 50e-6 * (1 + 1e-9))
