"""The data-poisoning and omniscient attacks (byzantine.py, hooks/attack_hook.py): labelflip,
alie and ipm against small numpy models of themselves on hand-made labels and gradients,
what is refused, and one short run per kind of attack against the one-device reference."""

import dataclasses
import json

import numpy as np
import pytest
import tensorflow as tf
import keras

from mgloop.training import losses
from mgloop.step.hooks import attacks as byzantine
from mgloop.data import padding
from mgloop.errors import ConfigError
from mgloop.step.hooks.attack_hook import ByzantineTowers, flip_labels
from tests import helpers, tolerance


def hook(attack, count=1, choice="fixed", total=4, per_unit=1, classes=None, seed=0):
    step = tf.Variable(tf.constant(7, tf.int64))
    return ByzantineTowers(byzantine.parse_attack(attack), count, choice, seed, step, 0, total,
                           "/device:CPU:0", per_unit, classes), step


# --- z_max --------------------------------------------------------------------------------

@pytest.mark.parametrize("n,f,quantile", [
    # (n - s) / n with s = floor(n/2 + 1) - f, and Phi^-1 of it from a normal table
    (4, 1, 0.5), (5, 1, 0.6), (4, 2, 0.75), (5, 2, 0.8), (50, 24, 0.96)])
def test_alie_z_is_the_papers_quantile(n, f, quantile):
    table = {0.5: 0.0, 0.6: 0.2533471031, 0.75: 0.6744897502, 0.8: 0.8416212336,
             0.96: 1.7506860713}
    # statistics.NormalDist.inv_cdf is accurate to ~1e-15 (Wichura's AS241); 1e-9: the table
    assert byzantine.alie_z(n, f) == pytest.approx(table[quantile], abs=1e-9)


def test_alie_z_refuses_a_majority_of_attackers():
    with pytest.raises(ConfigError, match=r"s = floor\(n/2 \+ 1\) - f = 0 < 1"):
        byzantine.alie_z(4, 3)


# --- alie and ipm on hand-made gradients ----------------------------------------------------

def made_gradients(towers, seed=1):
    """Per tower: a [3, 2] and a [4] gradient, values of mixed sign and magnitude."""
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal((3, 2)).astype(np.float32) * 3,
             rng.standard_normal(4).astype(np.float32)] for _ in range(towers)]


def numpy_attack(units, honest, name, value, ddof=0):
    """The attack from the honest units' gradients, in float64: mu - z sigma (population
    sigma, or with ddof=1 the sample one) or -epsilon mu."""
    h = np.asarray([units[u] for u in honest], np.float64)
    mu = h.mean(0)
    return mu - value * h.std(0, ddof=ddof) if name == "alie" else -value * mu


def attack_bound(units, honest, value):
    """|float32 - exact| of mu - z sigma (or -eps mu) over m honest values: the m-term sum
    and the division within gamma(m + 1) sum|g|/m; the deviations (one subtraction each,
    plus mu's error), their squares, sum and division and the square root within
    gamma(m + 4) of sigma's terms; the product with z and the difference, 2 more
    roundings (Higham ch. 3, first order), doubled for a margin."""
    h = np.abs(np.asarray([units[u] for u in honest], np.float64))
    m, scale = len(honest), h.mean(0) + h.max(0)
    return 2 * tolerance.gamma(m + 6) * (1 + abs(value)) * scale


def check_sent(sent, grads, per_unit, attackers, expected):
    for t, tower in enumerate(sent):
        for i, g in enumerate(tower):
            if t // per_unit in attackers:
                want, bound = expected[i]
                assert np.all(np.abs(g.numpy() - want) <= bound), (t, i)
            else:
                np.testing.assert_array_equal(g.numpy(), grads[t][i])  # honest: as computed


@pytest.mark.parametrize("attack,name,value", [
    ("alie:z=1.5", "alie", 1.5), ("alie:z=-0.7", "alie", -0.7),
    ("alie", "alie", byzantine.alie_z(5, 2)), ("ipm", "ipm", 0.1),
    ("ipm:epsilon=4", "ipm", 4.0)])
def test_omniscient_attacks_match_numpy(attack, name, value):
    grads = made_gradients(5)
    byz, _ = hook(attack, count=2, total=5)
    with byz.step_scope():
        sent = byz.alter_towers([[tf.constant(g) for g in tower] for tower in grads])
        assert byz.unscale(0, sent[0]) is sent[0]  # nothing more per tower
    honest = [2, 3, 4]
    expected = [(numpy_attack([g[i] for g in grads], honest, name, value),
                 attack_bound([g[i] for g in grads], honest, value)) for i in range(2)]
    check_sent(sent, grads, 1, {0, 1}, expected)


@pytest.mark.parametrize("attack,value", [("alie:z=1.5,ddof=1", 1.5),
                                          ("alie:z=-1.5,ddof=1", -1.5)])  # ByzFL's default
def test_alie_with_the_sample_sd_matches_numpy(attack, value):
    """ddof=1: sigma is the sample standard deviation of the 3 honest of 5 units (numpy's
    std with ddof=1, as ByzFL's ALittleIsEnough takes it), sqrt(3/2) times the population
    one that the default uses."""
    grads = made_gradients(5)
    byz, _ = hook(attack, count=2, total=5)
    with byz.step_scope():
        sent = byz.alter_towers([[tf.constant(g) for g in tower] for tower in grads])
    honest = [2, 3, 4]
    expected = [(numpy_attack([g[i] for g in grads], honest, "alie", value, ddof=1),
                 attack_bound([g[i] for g in grads], honest, value)) for i in range(2)]
    check_sent(sent, grads, 1, {0, 1}, expected)
    population = numpy_attack([g[0] for g in grads], honest, "alie", value)
    assert np.abs(sent[0][0].numpy() - population).max() > 10 * expected[0][1].max()


def test_omniscient_attack_with_random_choice_reads_the_steps_honest_towers():
    grads = made_gradients(5, seed=2)
    byz, step = hook("alie:z=2", count=2, choice="random", total=5, seed=4)
    chosen = set()
    for s in range(4):
        step.assign(s)
        with byz.step_scope():
            flags = byz.flags().numpy()
            sent = byz.alter_towers([[tf.constant(g) for g in tower] for tower in grads])
        attackers = set(np.flatnonzero(flags))
        honest = sorted(set(range(5)) - attackers)
        chosen.add(tuple(sorted(attackers)))
        expected = [(numpy_attack([g[i] for g in grads], honest, "alie", 2.0),
                     attack_bound([g[i] for g in grads], honest, 2.0)) for i in range(2)]
        check_sent(sent, grads, 1, attackers, expected)
    assert len(chosen) > 1  # the draw moves with the step


def test_omniscient_attack_between_nodes_uses_the_honest_nodes_means():
    # 3 nodes of 2 towers, node 0 attacking: both its towers send mu - z sigma of the means
    # of nodes 1 and 2, so node 0's mean is the attack
    grads = made_gradients(6, seed=3)
    byz, _ = hook("alie:z=1", count=1, total=6, per_unit=2)
    with byz.step_scope():
        sent = byz.alter_towers([[tf.constant(g) for g in tower] for tower in grads])
        np.testing.assert_array_equal(byz.flags().numpy(), [1, 1, 0, 0, 0, 0])
    means = [[(np.float64(grads[2 * u][i]) + grads[2 * u + 1][i]) / 2 for u in range(3)]
             for i in range(2)]
    # the node means add one sum of 2 and a halving before the attack's own roundings
    expected = [(numpy_attack(means[i], [1, 2], "alie", 1.0),
                 attack_bound(means[i], [1, 2], 1.0)
                 + 2 * tolerance.gamma(2) * (1 + 1.0) * np.abs(means[i][1:]).max(0))
                for i in range(2)]
    check_sent(sent, grads, 2, {0}, expected)


def test_sparse_gradients_are_made_dense_for_every_tower():
    rows = [tf.IndexedSlices(tf.constant([[1.0, 2.0]]) * (t + 1), tf.constant([t % 3]),
                             tf.constant([3, 2])) for t in range(4)]
    byz, _ = hook("ipm:epsilon=2", count=1, total=4)
    with byz.step_scope():
        sent = byz.alter_towers([[r] for r in rows])
    dense = [tf.convert_to_tensor(r).numpy() for r in rows]
    for t in range(4):
        assert not isinstance(sent[t][0], tf.IndexedSlices)
        # -2 * mean of towers 1..3 (exact here: small integers and their thirds' multiples)
        want = -2 * np.mean(dense[1:], 0) if t == 0 else dense[t]
        np.testing.assert_allclose(sent[t][0].numpy(), want, rtol=2 * tolerance.gamma(4))


# --- labelflip on hand-made labels -----------------------------------------------------------

def test_flip_labels_maps_class_ids_and_one_hot_rows_alike():
    logits = tf.zeros([4, 5])
    ids = tf.constant([0, 1, 3, 4], tf.int32)
    np.testing.assert_array_equal(flip_labels(ids, logits, 5).numpy(), [4, 3, 1, 0])
    np.testing.assert_array_equal(flip_labels(tf.reshape(ids, [4, 1]), logits, 5).numpy(),
                                  [[4], [3], [1], [0]])  # the trailing 1 the loss allows
    one_hot = tf.one_hot(ids, 5)
    np.testing.assert_array_equal(flip_labels(one_hot, logits, 5).numpy(),
                                  tf.one_hot([4, 3, 1, 0], 5).numpy())
    # one logit (two classes): float or int labels y -> 1 - y
    np.testing.assert_array_equal(flip_labels(tf.constant([0.0, 1.0]), tf.zeros([2, 1]), 2)
                                  .numpy(), [1.0, 0.0])
    # tokens [B, L] of a [B, L, K] output whose L happens to equal K: ids, not one-hot rows
    tokens = tf.constant([[0, 2, 1]])
    np.testing.assert_array_equal(flip_labels(tokens, tf.zeros([1, 3, 3]), 3).numpy(),
                                  [[2, 0, 1]])


@pytest.mark.parametrize("choice", ["fixed", "random"])
def test_labelflip_flips_the_attackers_labels_only(choice):
    byz, step = hook("labelflip", count=2, choice=choice, total=4, classes=10, seed=1)
    y, logits = tf.constant([0, 3, 9]), tf.zeros([3, 10])
    for s in range(3):
        step.assign(s)
        with byz.step_scope():
            flags = byz.flags().numpy()
            for t in range(4):
                got = byz.labels(t, y, logits)
                want = [9, 6, 0] if flags[t] else [0, 3, 9]
                np.testing.assert_array_equal(tf.convert_to_tensor(got).numpy(), want)
                assert byz.unscale(t, [tf.ones([2])])[0].numpy().tolist() == [1, 1]
            weighted = byz.labels(0, padding.Weighted(y, tf.ones([3])), logits)
            np.testing.assert_array_equal(weighted.labels.numpy(),
                                          [9, 6, 0] if flags[0] else [0, 3, 9])


def test_label_classes_is_the_width_the_cross_entropy_reads():
    def model(width, activation=None):
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(width, activation)])
    assert byzantine.label_classes(losses.cross_entropy, model(7)) == 7
    assert byzantine.label_classes(losses.CrossEntropy("softmax"), model(3, "softmax")) == 3
    assert byzantine.label_classes(losses.CrossEntropy("sigmoid"), model(1, "sigmoid")) == 2
    assert byzantine.label_classes(losses.cross_entropy, model(1)) == 2


@pytest.mark.parametrize("loss,width,activation,message", [
    (keras.losses.MeanSquaredError(), 3, None, "only mgloop's class cross-entropy"),
    (losses.CrossEntropy("sigmoid"), 3, "sigmoid", "3 sigmoid units"),
])
def test_labelflip_refuses_labels_that_are_not_class_ids(loss, width, activation, message):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(width, activation)])
    with pytest.raises(ConfigError, match=message) as error:
        byzantine.label_classes(loss, model)
    assert "\n" not in str(error.value)


def test_labelflip_with_a_users_loss_is_refused_before_any_copy(tmp_path):
    config = helpers.small_config(str(tmp_path), devices="cpu:4", aggregation="median",
                                  byzantine_towers=1, attack="labelflip")
    with pytest.raises(ConfigError, match="--attack=labelflip with the loss") as error:
        helpers.build_trainer(config, loss_fn=lambda y, z: tf.reduce_mean(tf.square(z)))
    assert "\n" not in str(error.value)


# --- refusals at validation -----------------------------------------------------------------

@pytest.mark.parametrize("overrides,message", [
    (dict(attack="alie:z=x"), "z='x' is not a number; give z=NUMBER"),
    (dict(attack="alie:ddof=2"), "ddof=2 is not 0 or 1; give ddof=0 (population sd, the "
                                 "default) or ddof=1 (sample sd, ByzFL's)"),
    (dict(byzantine_towers=3, attack="alie:z=1,ddof=1"),
     "the sample sd (ddof=1) needs 2 honest ones; use ddof=0 or --byzantine_towers <= 2"),
    (dict(attack="ipm:epsilon=0"), "--attack=ipm:epsilon=0"),
    (dict(attack="labelflip:factor=2"), "is not one of labelflip's options"),
    (dict(byzantine_towers=3, attack="alie"), "s = floor(n/2 + 1) - f = 0 < 1, is infinite"),
    (dict(byzantine_towers=2, nodes=3, attack="alie"),
     "s = floor(n/2 + 1) - f = 0 < 1, is infinite"),
])
def test_bad_attack_settings_are_refused_in_one_line(overrides, message, tmp_path):
    settings = {"aggregation": "median", "byzantine_towers": 1, **overrides}
    config = helpers.small_config(str(tmp_path), devices="cpu:6" if "nodes" in overrides
                                  else "cpu:4", global_batch_size=24, **settings)
    with pytest.raises(ConfigError) as error:
        config.validated()
    assert "\n" not in str(error.value) and message in str(error.value)


@pytest.mark.parametrize("attack", ["alie:z=1", "ipm"])
def test_omniscient_attacks_are_refused_across_workers(attack, tmp_path, monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["localhost:1", "localhost:2", "localhost:3"]},
        "task": {"type": "worker", "index": 0}}))
    config = helpers.small_config(str(tmp_path), devices="cpu:2", aggregation="median",
                                  byzantine_towers=1, attack=attack,
                                  global_batch_size=24)  # 6 shards: only the attack is refused
    with pytest.raises(ConfigError, match=f"--attack={attack} across 3 workers") as error:
        config.validated()
    assert "\n" not in str(error.value)


# --- one short run per kind of attack --------------------------------------------------------

def test_labelflip_run_equals_one_device_on_the_flipped_shard(tmp_path):
    # tower 0 of 4 differentiates its shard (the first 4 of 16 examples) with y' = 9 - y:
    # a step is the one-device step on the global batch whose first 4 labels are flipped
    # (the mean of the towers' shard losses is the global batch's mean loss)
    config = helpers.small_config(str(tmp_path), devices="cpu:4", aggregation="ring",
                                  optimizer="sgd", byzantine_towers=1, attack="labelflip")
    batches = helpers.batches(1)
    num_classes = helpers.DATASET.num_classes
    flipped = [(x, np.concatenate([num_classes - 1 - y[:4], y[4:]])) for x, y in batches]
    trainer, loss_sum = helpers.train_mgloop(config, batches)
    one_device = dataclasses.replace(config, byzantine_towers=0, attack="signflip")
    reference = helpers.train_reference_bounded(one_device, flipped)
    tolerance.assert_matches_reference(helpers.copy_weights(trainer)[0], loss_sum, reference)
    # and the flip changed the step: the reference on the true labels differs beyond it
    honest = helpers.train_reference_bounded(one_device, batches)
    assert any(np.any(np.abs(a - b) > t) for a, b, t in
               zip(honest[0], reference[0], reference[2].weights()))


def test_ipm_run_scales_the_honest_mean(tmp_path):
    # 4 towers, tower 0 sends -eps mu (mu: the 3 honest shards' mean gradient = the gradient
    # of the 12 honest examples' mean loss), so the mean update is (3 - eps)/4 mu: one SGD
    # step at lr (3 - eps)/4 on those 12 examples. ps_cpu with every variable above
    # --ordered_sum_bytes: the ordered sum is left out (else it would sum at home what the
    # attack never saw). The bound: the reference's (its order of the 12 examples' sums)
    # plus the attack's 4 roundings (/3, x eps, /4, x lr), within its 8 update roundings.
    eps, lr = 0.5, 0.1
    config = helpers.small_config(str(tmp_path), devices="cpu:4", aggregation="ps_cpu",
                                  optimizer="sgd", learning_rate=lr, byzantine_towers=1,
                                  attack=f"ipm:epsilon={eps}", ordered_sum_bytes=1,
                                  diagnostics=True)
    x, y = helpers.batches(1)[0]
    trainer = helpers.build_trainer(config)
    result = trainer.train_loop(iter(tf.data.Dataset.from_tensor_slices((x[None], y[None]))), 1)
    reference = helpers.train_reference_bounded(
        helpers.small_config(str(tmp_path), optimizer="sgd", learning_rate=lr * (3 - eps) / 4),
        [(x[4:], y[4:])])
    tolerance.assert_matches_reference(helpers.copy_weights(trainer)[0], None, reference)
    # the diagnostics see what the exchange got: tower 0 flagged, its norm eps ||mu||, and
    # ||mu|| <= the largest honest norm (a mean), so eps = 0.5 makes it the smallest
    stats = result.stats
    assert [stats[f"tower_{t}/byzantine"] for t in range(4)] == [1, 0, 0, 0]
    norms = [stats[f"tower_{t}/grad_norm"] for t in range(4)]
    assert 0 < norms[0] <= eps * max(norms[1:]) * (1 + 1e-5)
