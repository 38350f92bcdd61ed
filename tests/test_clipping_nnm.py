"""Centered clipping (centered_clipping.py) and nearest-neighbour mixing (nnm.py).

Both against float64 numpy models of the formulas in their docstrings, on hand-made
float32 tower gradients of 5-7 towers split into two variables (a [2, 2] and a [2]),
with outliers and ties: centered clipping's iterations and its centre carried across
calls as its state; NNM's neighbourhoods (itself first, ties to the lower index) and
mixed values, then NNM + Krum and NNM + median through the methods' `reduce`. As in
test_robust_aggregation.py, float32 roundings of these few-term sums, norms and sorts
are below 1e-6 relative, hence rtol=1e-5 (selections must match exactly). The lossless
settings: centered clipping with tau above every distance, from 0 in one iteration, is
the mean bit for bit, and from any centre within its docstring's (T + 4) u bound.
Then refusals, each method's declared bound with mixing, and two short runs through
mgloop.run (centered clipping resumed from its checkpoint bit for bit; Krum with NNM).
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import mgloop
from mgloop import aggregation
from mgloop.aggregation.robust import centered_clipping, nnm
from mgloop.cluster import devices
from mgloop.errors import ConfigError
from tests import helpers
from tests.test_robust_aggregation import f64, tower_gradients

RTOL = 1e-5
U = 2.0 ** -24  # float32 unit roundoff


def split(rows):
    """[T, 6] -> the two variables' stacks: [T, 2, 2] and [T, 2]."""
    return [tf.constant(rows[:, :4].reshape(-1, 2, 2)), tf.constant(rows[:, 4:])]


def joined(values):
    """One tower's (or the centre's) two variables -> its 6-vector."""
    return np.concatenate([np.asarray(v).reshape(-1) for v in values])


def on_one_device(spec, num):
    """The method on `num` towers placed on one device, built for the two variables."""
    method = aggregation.make(spec, devices.DeviceSet(towers=("/device:CPU:0",) * num))
    variables = [tf.Variable(tf.zeros([2, 2])), tf.Variable(tf.zeros([2]))]
    method.build(variables)
    return method, variables


def reduced(method, variables, rows):
    """Copy 0's result of one compiled `reduce` of `rows`, as a 6-vector; every copy equal."""
    values = [[tf.constant(r[:4].reshape(2, 2)), tf.constant(r[4:])] for r in rows]
    out = tf.function(lambda v: method.reduce(v, variables))(values)
    for copy in out:
        np.testing.assert_array_equal(joined(copy), joined(out[0]))
    return joined(out[0])


# ---- centered clipping ----

def cc_model(rows, start, tau, iterations):
    """Karimireddy et al.'s iterations in float64 on the whole vectors."""
    x, v = f64(rows), f64(start)
    for _ in range(iterations):
        d = x - v
        norms = np.linalg.norm(d, axis=1)
        c = np.where(norms > tau, tau / np.where(norms > 0, norms, 1), 1.0)
        v = v + (c[:, None] * d).mean(axis=0)
    return v


@pytest.mark.parametrize("tau,iterations", [(0.5, 1), (0.5, 3), (2.0, 2)])
def test_centered_clipping_is_its_numpy_model(tau, iterations):
    # near 0.9: the honest towers within tau of the start, the outlier (tower 2) clipped
    x = tower_gradients(6, seed=5, outliers=[2])
    start = np.full(6, 0.9, np.float32)
    out = centered_clipping.centered_clipping(
        split(x), [tf.constant(start[:4].reshape(2, 2)), tf.constant(start[4:])], tau,
        iterations)
    expected = cc_model(x, start, tau, iterations)
    np.testing.assert_allclose(joined(out), expected, rtol=RTOL)
    honest = np.delete(f64(x), 2, axis=0).mean(axis=0)  # the outlier pulls the mean, not it
    assert np.linalg.norm(expected - honest) < np.linalg.norm(f64(x).mean(axis=0) - honest) / 3


def test_clip_factors_are_one_within_tau_and_tau_over_the_distance_beyond():
    x = np.array([[3, 4, 0, 0, 0, 0], [0] * 6, [0.3, 0.4, 0, 0, 0, 0]], np.float32)
    c = centered_clipping.clip_factors(split(x), [tf.zeros([2, 2]), tf.zeros([2])], 1.0)
    np.testing.assert_allclose(c.numpy(), [1 / 5, 1, 1], rtol=RTOL)  # 0 distance: 1


def test_the_previous_output_is_the_next_start_and_the_state():
    """Two calls of `reduce` (compiled, 5 towers): the second starts from the first's
    output (0 before), which the state variables hold after each; center=zero keeps no
    state and starts from 0 every time."""
    method, variables = on_one_device("centered_clipping:tau=0.5,iterations=2", 5)
    assert [tuple(v.shape) for v in method.state_variables] == [(2, 2), (2,)]
    start = np.zeros(6)
    for seed in (1, 2):
        x = tower_gradients(5, seed=seed, outliers=[4])
        out = reduced(method, variables, x)
        expected = cc_model(x, start, 0.5, 2)
        np.testing.assert_allclose(out, expected, rtol=RTOL)
        np.testing.assert_array_equal(joined(method.state_variables), out)
        start = out
    zero, zero_variables = on_one_device(
        "centered_clipping:tau=0.5,iterations=2,center=zero", 5)
    assert zero.state_variables == []
    np.testing.assert_allclose(reduced(zero, zero_variables, x),
                               cc_model(x, np.zeros(6), 0.5, 2), rtol=RTOL)


def test_tau_above_every_distance_is_the_mean():
    """From 0 in one iteration every c_t is exactly 1: the tower-order mean, bit for bit
    (trimmed_mean:trim=0's). From another centre, the mean within the docstring's
    (T + 4) u (|v_0| + max_t |x_t|) per element."""
    x = tower_gradients(5, seed=7, outliers=[0])
    method, variables = on_one_device("centered_clipping:tau=1e6,center=zero", 5)
    mean, mean_variables = on_one_device("trimmed_mean:trim=0", 5)
    np.testing.assert_array_equal(reduced(method, variables, x),
                                  reduced(mean, mean_variables, x))
    carried, carried_variables = on_one_device("centered_clipping:tau=1e6", 5)
    start = np.array([3.0, -7.5, 0.1, 1e3, -2.0, 0.0])
    for state, part in zip(carried.state_variables, (start[:4].reshape(2, 2), start[4:])):
        state.assign(part)
    out = reduced(carried, carried_variables, x)
    bound = (5 + 4) * U * (np.abs(start) + np.abs(f64(x)).max(axis=0))
    assert np.all(np.abs(out - f64(x).mean(axis=0)) <= bound)


# ---- nearest-neighbour mixing ----

def nnm_model(x, f):
    """(neighbourhoods, mixed rows): N_i is x_i, then the nearest by (distance, index)."""
    x = f64(x)
    num = len(x)
    hoods = []
    for i in range(num):
        d = ((x - x[i]) ** 2).sum(axis=1)
        hoods.append(sorted(sorted(range(num), key=lambda j: (j != i, d[j], j))[:num - f]))
    return hoods, np.array([x[h].mean(axis=0) for h in hoods])


# small integers: every distance exact in float32, so the ties are ties. Towers 1 and 5
# are identical (tower 5's own place comes first, then tower 1's); from tower 0, towers
# 1, 2, 5 are all at 1 and 3, 4 at 4; tower 6 is the outlier.
HAND_MADE = np.array([[0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [-1, 0, 0, 0, 0, 0],
                      [0, 2, 0, 0, 0, 0], [0, -2, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0],
                      [10, 10, 10, 0, 0, 10]], np.float32)


@pytest.mark.parametrize("f", [1, 2, 3])
def test_neighbourhoods_with_ties_and_duplicates(f):
    hoods, mixed = nnm_model(HAND_MADE, f)
    got = nnm.neighbourhoods(tf.constant(HAND_MADE), f).numpy()
    assert [list(row) for row in got] == hoods
    assert all(i in hood for i, hood in enumerate(hoods))
    out = nnm.mix(split(HAND_MADE), tf.constant(HAND_MADE), f)
    np.testing.assert_allclose(np.stack([joined([v[t] for v in out]) for t in range(7)]),
                               mixed, rtol=RTOL)


def test_nnm_then_krum_and_median_are_their_models_on_the_mixed_gradients():
    """7 towers, 2 outliers: `krum:f=2,nnm=2` picks, among the mixed rows, the one whose
    T - f - 2 nearest mixed rows are closest; `median:nnm=2` is their coordinate median."""
    x = tower_gradients(7, seed=11, outliers=[0, 3])
    _, y = nnm_model(x, 2)
    d = ((y[:, None] - y[None]) ** 2).sum(-1)
    scores = [np.sort(np.delete(d[i], i))[:7 - 2 - 2].sum() for i in range(7)]
    method, variables = on_one_device("krum:f=2,nnm=2", 7)
    np.testing.assert_allclose(reduced(method, variables, x), y[np.argmin(scores)], rtol=RTOL)
    method, variables = on_one_device("median:nnm=2", 7)
    np.testing.assert_allclose(reduced(method, variables, x), np.median(y, axis=0), rtol=RTOL)


def test_the_mean_with_nnm_mixes_first():
    """trimmed_mean:trim=0 short-cuts to the exact mean; with nnm it averages the mixed
    rows, which is not the mean (x_s counts once per neighbourhood holding it)."""
    x = tower_gradients(5, seed=2, outliers=[1])
    method, variables = on_one_device("trimmed_mean:trim=0,nnm=2", 5)
    out = reduced(method, variables, x)
    np.testing.assert_allclose(out, nnm_model(x, 2)[1].mean(axis=0), rtol=RTOL)
    assert np.abs(out - f64(x).mean(axis=0)).max() > 0.1


ROBUST_WITH_NNM = ["median:nnm=3", "trimmed_mean:trim=0,nnm=1", "trimmed_mean:trim=2,nnm=2",
                   "krum:f=2,nnm=3", "multikrum:f=0,m=7,nnm=1", "multikrum:f=1,nnm=2",
                   "bulyan:f=1,nnm=1", "bulyan:f=0,nnm=2", "geomedian:nnm=2",
                   "centered_clipping:tau=0.5,nnm=2", "centered_clipping:nnm=3"]


@pytest.mark.parametrize("spec", ROBUST_WITH_NNM)
def test_with_mixing_identical_gradients_give_them_and_others_stay_in_the_bound(spec):
    """Mean semantics: 7 identical gradients g give g (centered clipping: g within tau of
    its start, 0 here; ||g|| ~ 2.4 > 0.5 moves it by 0.5 only). On 7 towers with two
    outliers the result is within the declared error_bound rho of the mean: per variable,
    ||out[v] - mean[v]|| <= rho G_v (G_v: the largest tower's ||x_t[v]||)."""
    method_type, options = aggregation.parse(spec)
    method_type.check(devices.DeviceRequest("cpu", tuple(range(7))), options)
    rho = method_type.error_bound(options, 7)
    assert rho is not None  # with mixing no setting is the mean
    same = np.repeat(tower_gradients(1, seed=4), 7, axis=0)
    method, variables = on_one_device(spec, 7)
    if "tau=0.5" not in spec:
        np.testing.assert_allclose(reduced(method, variables, same), same[0], rtol=RTOL)
    else:
        clipped = 0.5 * f64(same[0]) / np.linalg.norm(f64(same[0]))
        np.testing.assert_allclose(reduced(method, variables, same), clipped, rtol=RTOL)
    method, variables = on_one_device(spec, 7)
    x = tower_gradients(7, seed=6, outliers=[2, 5])
    out, mean = reduced(method, variables, x), f64(x).mean(axis=0)
    for part in (slice(0, 4), slice(4, 6)):
        g = np.linalg.norm(f64(x)[:, part], axis=1).max()
        assert np.linalg.norm(out[part] - mean[part]) <= rho * g


def test_declared_bounds():
    bound = lambda spec, towers: aggregation.get(spec).error_bound(  # noqa: E731
        aggregation.parse(spec)[1], towers)
    assert bound("trimmed_mean:trim=0", 5) is None
    assert bound("multikrum:f=0,m=5", 5) is None and bound("bulyan:f=0", 5) is None
    for spec in ("trimmed_mean:trim=0,nnm=1", "multikrum:f=0,m=5,nnm=1",
                 "bulyan:f=0,nnm=1", "krum:f=1,nnm=2", "centered_clipping",
                 "centered_clipping:center=zero,tau=1e30"):
        assert bound(spec, 5) == pytest.approx(2.0, abs=1e-4), spec
    assert bound("median:nnm=2", 5) == bound("median", 5) == pytest.approx(2 * 5 ** 0.5,
                                                                           abs=1e-4)


@pytest.mark.parametrize("spec,towers,message", [
    ("krum:f=1,nnm=3", 6, "needs at least 7 towers (2 nnm + 1 = 7 for nnm=3)"),
    ("median:nnm=2", 4, "use nnm <= 1 or at least 5 towers"),
    ("geomedian:nnm=1", 2, "use nnm <= 0 or at least 3 towers"),
    ("centered_clipping:nnm=3", 5, "2 nnm + 1 = 7 for nnm=3")])
def test_mixing_needs_more_than_twice_nnm_towers(spec, towers, message):
    method, options = aggregation.parse(spec)
    with pytest.raises(ConfigError) as error:
        method.check(devices.DeviceRequest("cpu", tuple(range(towers))), options)
    text = str(error.value)
    assert "\n" not in text and message in text and "nnm=" in text
    assert text.startswith(f"--aggregation={spec.split(':')[0]}:")


@pytest.mark.parametrize("spec,message", [
    ("centered_clipping:tau=0", "option tau=0 is out of range: must be > 0.0"),
    ("centered_clipping:iterations=0", "option iterations=0 is out of range"),
    ("centered_clipping:center=middle", "must be one of previous|zero"),
    ("krum:nnm=-1", "option nnm=-1 is out of range: must be >= 0"),
    ("adasum:nnm=1", "adasum has no option 'nnm'")])
def test_bad_options_are_refused_in_one_line(spec, message):
    with pytest.raises(ConfigError) as error:
        aggregation.parse(spec)
    assert "\n" not in str(error.value) and message in str(error.value)


# ---- short runs ----

def checkpoint_tensors(logdir):
    reader = tf.train.load_checkpoint(os.path.join(logdir, "checkpoints"))
    return {key: reader.get_tensor(key) for key in reader.get_variable_to_dtype_map()
            if not key.startswith(("save_counter", "_CHECKPOINTABLE_OBJECT_GRAPH"))}


def test_centered_clipping_trains_and_resumes_its_centre_bit_for_bit(tmp_path):
    """centered_clipping:tau=1 (the MLP's tower gradients here are ~7 long: clipped) on 4
    towers through mgloop.run: 4 steps straight equal 2 steps, a checkpoint, and 2 more
    resumed, bit for bit under --deterministic (every tensor of the last checkpoint: the
    weights, the optimizer, the centre), the centre moved, the loss finite."""
    def run(name, steps):
        return mgloop.run(helpers.small_config(
            str(tmp_path / name), devices="cpu:4", aggregation="centered_clipping:tau=1",
            train_steps=steps, steps_per_loop=2, checkpoint_every=0, eval_every=0))
    straight = run("straight", 4)
    assert np.isfinite(straight["final_train_loss"])
    assert run("resumed", 2)["final_step"] == 2
    assert run("resumed", 4)["start_step"] == 2
    a, b = (checkpoint_tensors(tmp_path / n) for n in ("straight", "resumed"))
    centre = [k for k in a if k.startswith("aggregation_state/centered_clipping/")]
    assert centre and all(np.abs(a[k]).max() > 0 for k in centre)
    assert a.keys() == b.keys()
    for key, value in a.items():
        np.testing.assert_array_equal(b[key], value, err_msg=key)


def test_krum_with_nnm_trains_with_identical_replicas(tmp_path):
    """krum:f=0,nnm=1 on 4 towers, 5 steps: every copy holds the same weights (one result
    broadcast), finite and moved."""
    trainer, loss_sum = helpers.train_mgloop(
        helpers.small_config(str(tmp_path), devices="cpu:4", aggregation="krum:f=0,nnm=1"),
        helpers.batches(5))
    copies = helpers.copy_weights(trainer)
    assert np.isfinite(loss_sum)
    for copy in copies[1:]:
        for a, b in zip(copy, copies[0]):
            np.testing.assert_array_equal(a, b)
    start = helpers.copy_weights(helpers.build_trainer(
        helpers.small_config(str(tmp_path / "fresh"), devices="cpu:4",
                             aggregation="krum:f=0,nnm=1")))[0]
    assert any(np.abs(a - b).max() > 0 for a, b in zip(copies[0], start))
