"""Robust aggregators and Adasum against small numpy models on hand-made tower gradients.

Each function of the methods' modules (median.py, trimmed_mean.py, krum.py, bulyan.py,
geomedian.py, adasum.py) is run by TensorFlow on float32 tower gradients and compared
with a float64 numpy model of the formula in its docstring. Float32 roundings of these
few-term sums and sorts are below 1e-6 relative, hence rtol=1e-5 for the formulas
(selection results, Krum's and Bulyan's choices, must match exactly).
"""

import itertools

import numpy as np
import pytest
import tensorflow as tf

from mgloop import aggregation
from mgloop.aggregation.dense import adasum
from mgloop.aggregation.robust import bulyan, geomedian, krum, median, trimmed_mean
from mgloop.cluster import devices
from mgloop.errors import ConfigError
from tests import helpers, tolerance

RTOL = 1e-5


def tower_gradients(num, seed=0, outliers=()):
    """[num, 6] float32 honest rows near (1, ..., 1); rows in `outliers` far away."""
    rng = np.random.default_rng(seed)
    rows = 1.0 + 0.1 * rng.standard_normal((num, 6))
    for t in outliers:
        rows[t] = -10.0 * rows[t]
    return rows.astype(np.float32)


def f64(x):
    return np.asarray(x, np.float64)


@pytest.mark.parametrize("num", [1, 2, 3, 4, 5])
def test_median_is_numpys(num):
    x = tower_gradients(num, outliers=[0] if num > 2 else [])
    np.testing.assert_allclose(median.coordinate_median(tf.constant(x)).numpy(),
                               np.median(f64(x), axis=0), rtol=RTOL)


@pytest.mark.parametrize("num,trim", [(3, 1), (5, 1), (5, 2), (4, 0), (6, 2)])
def test_trimmed_mean_leaves_out_b_at_each_end(num, trim):
    x = tower_gradients(num, seed=num, outliers=[1])
    expected = np.sort(f64(x), axis=0)[trim:num - trim].mean(axis=0)
    np.testing.assert_allclose(trimmed_mean.trimmed_mean(tf.constant(x), trim).numpy(),
                               expected, rtol=RTOL)


def krum_scores_model(x, f):
    num = len(x)
    d = ((f64(x)[:, None] - f64(x)[None]) ** 2).sum(-1)
    k = num - f - 2
    return np.array([np.sort(np.delete(d[i], i))[:k].sum() for i in range(num)])


@pytest.mark.parametrize("num,f", [(5, 1), (7, 2), (4, 0)])
def test_krum_scores_and_selection(num, f):
    x = tower_gradients(num, seed=num + f, outliers=range(f))
    scores = krum.krum_scores(krum.squared_distances(tf.constant(x)), num - f - 2).numpy()
    expected = krum_scores_model(x, f)
    np.testing.assert_allclose(scores, expected, rtol=RTOL)
    assert np.argmin(scores) == np.argmin(expected) >= f  # an honest tower is chosen
    m = num - f
    chosen = krum.lowest(tf.constant(scores), m).numpy()
    assert list(chosen) == sorted(np.argsort(expected)[:m])
    np.testing.assert_allclose(krum.chosen_mean(tf.constant(x), tf.constant(chosen), m).numpy(),
                               f64(x)[chosen].mean(axis=0), rtol=RTOL)


def test_krum_picks_the_centre_of_a_hand_made_cluster():
    # four points around the origin on a line, one far: the middle ones have the smallest
    # sums of squared distances to their 5 - 1 - 2 = 2 nearest neighbours
    x = np.array([[-2.0, 0], [-0.5, 0], [0.25, 0], [2.0, 0], [100.0, 100.0]], np.float32)
    scores = krum.krum_scores(krum.squared_distances(tf.constant(x)), 2).numpy()
    np.testing.assert_allclose(scores, [1.5**2 + 2.25**2, 0.75**2 + 1.5**2, 0.75**2 + 1.75**2,
                                        1.75**2 + 2.5**2, scores[4]], rtol=RTOL)
    assert np.argmin(scores) == 1 and scores[4] > 1e4


def bulyan_model(x, f):
    """El Mhamdi et al.: theta Krum rounds on the remaining towers, then per coordinate the
    mean of the beta selected values closest to their median."""
    x = f64(x)
    num = len(x)
    remaining, chosen = list(range(num)), []
    for _ in range(num - 2 * f):
        sub = x[remaining]
        k = max(len(remaining) - f - 2, 0)
        d = ((sub[:, None] - sub[None]) ** 2).sum(-1)
        scores = [np.sort(np.delete(d[i], i))[:k].sum() for i in range(len(sub))]
        chosen.append(remaining.pop(int(np.argmin(scores))))
    selected = x[chosen]
    beta = len(chosen) - 2 * f
    nearest = np.argsort(np.abs(selected - np.median(selected, axis=0)), axis=0,
                         kind="stable")[:beta]
    return chosen, np.take_along_axis(selected, nearest, axis=0).mean(axis=0)


@pytest.mark.parametrize("num,f", [(7, 1), (11, 2)])
def test_bulyan_selection_and_coordinate_mean(num, f):
    x = tower_gradients(num, seed=num, outliers=range(num - f, num))
    chosen, expected = bulyan_model(x, f)
    order = bulyan.bulyan_selection(tf.constant(x), f).numpy()
    assert list(order) == chosen and not set(order) & set(range(num - f, num))
    out = bulyan.closest_to_median_mean(tf.gather(tf.constant(x), order), num - 4 * f)
    np.testing.assert_allclose(out.numpy(), expected, rtol=RTOL)


def adasum_model(a, b):
    a, b = f64(a), f64(b)
    dot = a @ b
    return (1 - dot / (2 * a @ a)) * a + (1 - dot / (2 * b @ b)) * b


def test_adasum_pairwise_formula_and_its_limits():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 9)).astype(np.float32)
    np.testing.assert_allclose(adasum.pairwise_adasum(tf.constant(a), tf.constant(b)).numpy(),
                               adasum_model(a, b), rtol=RTOL, atol=1e-6)
    e0, e1 = np.eye(2, dtype=np.float32)
    np.testing.assert_allclose(adasum.pairwise_adasum(e0 * 3, e1 * 2).numpy(), [3, 2])  # sum
    np.testing.assert_allclose(adasum.pairwise_adasum(a, a).numpy(), a, rtol=RTOL)  # mean
    np.testing.assert_array_equal(adasum.pairwise_adasum(np.zeros(9, np.float32), b).numpy(), b)


@pytest.mark.parametrize("num", [1, 2, 4, 8])
def test_adasum_recursion_pairs_as_horovod(num):
    rows = tower_gradients(num, seed=num)
    level = [f64(r) for r in rows]
    while len(level) > 1:  # (0,1), (2,3), ... then their results, lower index as a
        level = [adasum_model(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    out = adasum.recursive_adasum([tf.constant(r) for r in rows]).numpy()
    np.testing.assert_allclose(out, level[0], rtol=RTOL)
    same = adasum.recursive_adasum([tf.constant(rows[0])] * num).numpy()
    np.testing.assert_allclose(same, rows[0], rtol=RTOL)  # T identical gradients: g


def test_geometric_median_within_its_certified_tolerance():
    x = tower_gradients(5, seed=4, outliers=[0])
    tolerance = 1e-4
    weights, iterations = geomedian.weiszfeld(tf.constant(x), tolerance, 1000, 1e-8)
    z = weights.numpy().astype(np.float64) @ f64(x)
    assert 1 < int(iterations) < 1000  # the rule stopped it, not the cap
    objective = lambda p: np.linalg.norm(f64(x) - p, axis=1).sum()  # noqa: E731
    best = f64(x).mean(axis=0)
    for _ in range(20000):  # float64 Weiszfeld run far past the rule: F(z*) to ~1e-12
        w = 1 / np.linalg.norm(f64(x) - best, axis=1)
        best = w @ f64(x) / w.sum()
    diameter = max(np.linalg.norm(a - b) for a, b in itertools.combinations(f64(x), 2))
    gap = (objective(z) - objective(best)) / len(x)
    assert -1e-6 <= gap <= tolerance * diameter + 1e-6  # + float32 rounding of z
    assert np.linalg.norm(z - best) < np.linalg.norm(f64(x).mean(axis=0) - best) / 10
    assert np.linalg.norm(z - best) < 0.1 * np.linalg.norm(x[0] - best)  # the outlier's pull


def test_methods_gather_on_tower_0_and_broadcast_one_tensor():
    device_set = devices.setup(devices.parse("cpu:4"))
    method = aggregation.make("multikrum:f=0,m=2", device_set)
    x = tower_gradients(4, seed=9, outliers=[2])
    variables = [tf.Variable(tf.zeros([6]))]
    placed = []
    for device, row in zip(device_set.towers, x):
        with tf.device(device):
            placed.append([tf.constant(row)])
    with method.step():
        out = method.reduce(placed, variables)
    scores = krum_scores_model(x, 0)
    expected = f64(x)[np.argsort(scores)[:2]].mean(axis=0)
    for per_copy in out:
        np.testing.assert_array_equal(per_copy[0].numpy(), out[0][0].numpy())
    np.testing.assert_allclose(out[0][0].numpy(), expected, rtol=RTOL)
    size = 6 * 4
    traffic = method.traffic.as_dict()
    summed = method.reduce(placed, variables, average=False)  # --grad_reduce=sum: T x
    np.testing.assert_allclose(summed[1][0].numpy(), 4 * out[0][0].numpy(), rtol=RTOL)
    assert traffic["CPU:0"] == {"sent": 3 * size, "received": 3 * size}
    assert all(traffic[f"CPU:{t}"] == {"sent": size, "received": size} for t in (1, 2, 3))


@pytest.mark.parametrize("spec,towers,needed", [
    ("krum:f=1", 4, "at least 5 towers (2f + 3 = 5 for f=1); --devices gives 4 towers: use "
                    "f <= 0 or at least 5 towers"),
    ("krum:f=1", 2, "--devices gives 2 towers: use at least 5 towers"),
    ("multikrum:f=1", 4, "2f + 3 = 5"),
    ("bulyan:f=1", 4, "at least 7 towers (4f + 3 = 7 for f=1); --devices gives 4 towers: use "
                      "f <= 0 or at least 7 towers"),
    ("bulyan:f=1", 2, "use at least 7 towers"),
    ("trimmed_mean:trim=2", 4, "(2b + 1 = 5 for trim=2); --devices gives 4 towers: use "
                               "trim <= 1 or at least 5 towers"),
    ("adasum", 3, "needs a power-of-two count of towers (its pairwise tree, as Horovod's); "
                  "--devices gives 3 towers: use 2 or 4 towers"),
    ("multikrum:f=0,m=5", 4, "(m = 5 for m=5); --devices gives 4 towers: use m <= 4 or at "
                             "least 5 towers"),
    ("krum:f=1,nnm=2", 4, "use nnm <= 1 and f <= 0 or at least 5 towers")])
def test_tower_counts_a_method_cannot_serve_are_refused_in_one_line(spec, towers, needed):
    method, options = aggregation.parse(spec)
    with pytest.raises(ConfigError) as error:
        method.check(devices.DeviceRequest("cpu", tuple(range(towers))), options)
    assert "\n" not in str(error.value) and needed in str(error.value)
    assert str(error.value).startswith(f"--aggregation={spec.split(':')[0]}")


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The single-device reference of 5 steps on helpers' batches (weights, loss, bound)."""
    config = helpers.small_config(str(tmp_path_factory.mktemp("reference")))
    return helpers.train_reference_bounded(config, helpers.batches(5))


@pytest.mark.parametrize("spec", ["trimmed_mean:trim=0", "multikrum:f=0,m=4"])
def test_identity_settings_equal_synchronous_training(spec, one_device, tmp_path):
    """trim=0 keeps every value and f=0, m=T averages every tower: the mean, so 5 steps on
    4 towers equal one device (synchronous training's reference) within tolerance.py's
    bound on any other order of the float32 sums."""
    method, options = aggregation.parse(spec)
    assert not method.capabilities.exact and method.error_bound(options, 4) is None
    trainer, loss_sum = helpers.train_mgloop(
        helpers.small_config(str(tmp_path), devices="cpu:4", aggregation=spec),
        helpers.batches(5))
    for weights in helpers.copy_weights(trainer):
        tolerance.assert_matches_reference(weights, loss_sum, one_device)


def test_bulyan_f1_reduce_compiled_on_seven_towers():
    """The method's whole path (gather, selection on the flattened vector, per-element
    means, broadcast) in a tf.function, on 7 towers (4f + 3 for f = 1) placed on one
    device, against the numpy model on the two variables concatenated."""
    device_set = devices.DeviceSet(towers=("/device:CPU:0",) * 7)
    method = aggregation.make("bulyan:f=1", device_set)
    x = tower_gradients(7, seed=3, outliers=[5])
    variables = [tf.Variable(tf.zeros([2, 2])), tf.Variable(tf.zeros([2]))]
    values = [[tf.constant(row[:4].reshape(2, 2)), tf.constant(row[4:])] for row in x]
    out = tf.function(lambda v: method.reduce(v, variables))(values)
    _, expected = bulyan_model(x, 1)
    assert len(out) == 1  # one copy per device: the 7 towers share one (device_groups.py)
    np.testing.assert_allclose(out[0][0].numpy().ravel(), expected[:4], rtol=RTOL)
    np.testing.assert_allclose(out[0][1].numpy(), expected[4:], rtol=RTOL)
