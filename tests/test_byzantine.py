"""Fault injection (`--byzantine_towers`, `--attack`, `--byzantine_choice`; byzantine.py and
hooks/attack_hook.py): what the attacks send, which towers, where it is reported, what is
refused, and the robustness result of the issue: with one of four towers sign-flipped x10
the mean fails to learn while the median and Krum learn."""


import numpy as np
import pytest
import tensorflow as tf

from mgloop.runs import run_dir
from mgloop.step.hooks import attacks as byzantine
from mgloop.errors import ConfigError
from mgloop.step.hooks.attack_hook import ByzantineTowers
from tests import helpers


def hook(attack, count=1, choice="fixed", total=4, seed=0):
    step = tf.Variable(tf.constant(7, tf.int64))
    return ByzantineTowers(byzantine.parse_attack(attack), count, choice, seed, step, 0, total,
                           "/device:CPU:0"), step


@pytest.mark.parametrize("attack,expected", [
    ("signflip", lambda g: -g), ("signflip:factor=10", lambda g: -10 * g),
    ("scaled:factor=3", lambda g: 3 * g), ("scaled", lambda g: 10 * g),
    ("zero", lambda g: 0 * g)])
def test_attacks_alter_the_chosen_towers_only(attack, expected):
    byz, _ = hook(attack, count=2)
    grads = [tf.constant([[1.0, -2.0], [0.5, 4.0]]), tf.constant([3.0])]
    with byz.step_scope():
        for t in range(4):
            out = byz.unscale(t, grads)
            for g, o in zip(grads, out):
                np.testing.assert_array_equal(o.numpy(), (expected(g) if t < 2 else g).numpy())
        np.testing.assert_array_equal(byz.flags().numpy(), [1, 1, 0, 0])


def test_gaussian_attack_replaces_the_gradient_by_seeded_noise():
    byz, step = hook("gaussian:std=2.5")
    grads = [tf.fill([200, 100], 7.0)]
    with byz.step_scope():
        first = byz.unscale(0, grads)[0].numpy()
        again = byz.unscale(0, grads)[0].numpy()
        other = byz.unscale(1, grads)[0].numpy()  # honest: untouched
    # 20000 draws: the sample mean and std lie within 6 standard errors of 0 and 2.5
    assert abs(first.mean()) < 6 * 2.5 / np.sqrt(first.size)
    assert abs(first.std() - 2.5) < 6 * 2.5 / np.sqrt(2 * first.size)
    np.testing.assert_array_equal(first, again)  # a function of (seed, step, tower, variable)
    np.testing.assert_array_equal(other, grads[0].numpy())
    step.assign(8)
    with byz.step_scope():
        assert not np.array_equal(byz.unscale(0, grads)[0].numpy(), first)  # a new step


def test_random_choice_draws_k_towers_per_step_seeded():
    drawn = []
    for seed in (5, 5, 6):
        byz, step = hook("zero", count=2, choice="random", total=8, seed=seed)
        flags = []
        for s in range(12):
            step.assign(s)
            with byz.step_scope():
                flags.append(byz.flags().numpy())
                g = [tf.ones([3])]
                altered = [t for t in range(8) if byz.unscale(t, g)[0].numpy().sum() == 0]
            assert flags[-1].sum() == 2 and altered == list(np.flatnonzero(flags[-1]))
        drawn.append(np.array(flags))
    np.testing.assert_array_equal(drawn[0], drawn[1])  # seeded
    assert not np.array_equal(drawn[0], drawn[2])  # another seed, other towers
    assert len({tuple(f) for f in drawn[0]}) > 3  # not the same towers every step


@pytest.mark.parametrize("overrides,message", [
    (dict(byzantine_towers=4), "--byzantine_towers=4 is out of range"),
    (dict(byzantine_towers=-1), "--byzantine_towers=-1 is out of range"),
    (dict(byzantine_towers=1, attack="flip"), "--attack='flip': 'flip' is not one of"),
    (dict(byzantine_towers=1, attack="scaled:std=2"), "is not one of scaled's options"),
    (dict(byzantine_towers=1, attack="gaussian:std=-1"), "--attack=gaussian:std=-1"),
    (dict(byzantine_towers=1, attack="signflip:factor=x"), "factor='x' is not a number"),
    (dict(attack="zero"), "--attack=zero with --byzantine_towers=0 alters no tower"),
    (dict(byzantine_choice="random"), "--byzantine_choice=random with"),
    (dict(byzantine_choice="some"), "--byzantine_choice='some' is not one of"),
    (dict(byzantine_towers=1, aggregation="colocate"), "none per tower to alter"),
])
def test_bad_settings_are_refused_in_one_line(overrides, message, tmp_path):
    config = helpers.small_config(str(tmp_path), devices="cpu:4",
                                  **{"aggregation": "ring", **overrides})
    with pytest.raises(ConfigError) as error:
        config.validated()
    assert "\n" not in str(error.value) and message in str(error.value)


def test_settings_are_in_hparams(tmp_path):
    config = helpers.small_config(str(tmp_path), devices="cpu:4", aggregation="median",
                                  byzantine_towers=1, attack="signflip:factor=10",
                                  byzantine_choice="random").validated()
    hparams = run_dir.hparams_of(config, 4)
    assert (hparams["byzantine_towers"], hparams["attack"], hparams["byzantine_choice"]) == (
        1, "signflip:factor=10", "random")


STEPS, BATCH = 20, 64


@pytest.fixture(scope="module")
def attacked_runs(tmp_path_factory):
    """{method: (loss of the first step, mean loss of the last 5, the diagnostics sampled
    on the last step)} on 4 towers, tower 0 sending -10 g every step; plain SGD at 0.1 on
    the synthetic task; the median's run with --diagnostics."""
    batches = helpers.batches(STEPS, BATCH)
    runs = {}
    for method in ("reduce_broadcast", "median", "krum:f=0"):
        config = helpers.small_config(
            str(tmp_path_factory.mktemp("byzantine")), devices="cpu:4", aggregation=method,
            global_batch_size=BATCH, optimizer="sgd", learning_rate=0.1, steps_per_loop=STEPS,
            byzantine_towers=1, attack="signflip:factor=10", diagnostics=method == "median")
        trainer = helpers.build_trainer(config)
        first = helpers.run_batches(trainer, batches[:1])
        helpers.run_batches(trainer, batches[1:-5])
        last = trainer.train_loop(iter(tf.data.Dataset.from_tensor_slices(
            tuple(np.stack(a) for a in zip(*batches[-5:])))), 5)
        runs[method] = (first, last.loss_sum / 5, last.stats)
    return runs


def test_diagnostics_show_the_altered_tower(attacked_runs):
    stats = attacked_runs["median"][2]
    assert [stats[f"tower_{t}/byzantine"] for t in range(4)] == [1, 0, 0, 0]
    norms = [stats[f"tower_{t}/grad_norm"] for t in range(4)]
    # what tower 0 sent: 10 times its own gradient's norm, which is no smaller than a
    # third of the others' on this task (a shard of 16 of the same distribution)
    assert norms[0] > 3 * max(norms[1:])


def test_mean_fails_under_one_sign_flipped_tower(attacked_runs):
    # its update is (g0' + g1 + g2 + g3)/4 with g0' = -10 g0: about -7/4 of the mean
    # gradient, an ascent: the loss rises (or overflows), whatever the seed
    first, last, _ = attacked_runs["reduce_broadcast"]
    assert not np.isfinite(last) or last > first


@pytest.mark.parametrize("method", ["median", "krum:f=0"])
def test_median_and_krum_learn_under_one_sign_flipped_tower(attacked_runs, method):
    # the attacked tower is an outlier on every coordinate (median) and far from the three
    # honest gradients (Krum's 2 nearest neighbours): the update stays a descent direction
    first, last, _ = attacked_runs[method]
    assert np.isfinite(last) and last < 0.85 * first
