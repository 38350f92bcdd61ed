"""Beyond synchronous averaging: localsgd, diloco (local_steps.py), delay and drop (stale.py).

The identity settings `localsgd:period=1`, `diloco:period=1,outer_lr=1,outer_momentum=0`
and `delay:d=0` are checked against one device on 2 and 4 towers by the contract test
(their `identity`); here: `drop:k=0` and localsgd's warmup (synchronous for its first W
steps), stale reads, dropped towers, the divergence saw-tooth, DiLoCo's outer step and a
resume mid-period.
"""

import dataclasses
import os

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import config as tf_config

import mgloop
from mgloop import aggregation
from mgloop.observe import diagnostics
from mgloop.step.hooks import Hook
from tests import helpers, tolerance
from tests.test_step import build

U = 2.0 ** -24  # float32 unit roundoff


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-device run of the small config on 5 batches (weights, loss sum, bound)."""
    config = helpers.small_config(str(tmp_path_factory.mktemp("reference")))
    return helpers.train_reference_bounded(config, helpers.batches(5))


@pytest.mark.parametrize("spec", ["drop:k=0", "localsgd:period=3,warmup_steps=5"])
def test_identity_settings_equal_one_device(spec, reference, logdir):
    """drop:k=0 is the mean over every tower; localsgd's first W = 5 steps average the
    gradients (its first parameter averaging would close step 8): within the one-device
    run's float32 bound (tests/tolerance.py), on 2 towers, after 5 steps."""
    config = helpers.small_config(logdir, devices="cpu:2", aggregation=spec)
    trainer, loss_sum = helpers.train_mgloop(config, helpers.batches(5))
    expected = reference
    for weights in helpers.copy_weights(trainer):
        tolerance.assert_matches_reference(weights, loss_sum, expected)


class KeepTowerGradients(Hook):
    """Keeps every tower's gradients of the last step in variables (made on first trace)."""

    kept = None

    def observe(self, losses, grads):
        if self.kept is None:
            with tf.init_scope():
                self.kept = [[tf.Variable(tf.zeros(g.shape, g.dtype), trainable=False)
                              for g in tower_grads] for tower_grads in grads]
        for kept, tower_grads in zip(self.kept, grads):
            for variable, g in zip(kept, tower_grads):
                variable.assign(g)


def gradient_apart(trainer, weights, x, y):
    """d (mean loss over (x, y)) / d v at `weights`, computed eagerly on CPU:0."""
    model = trainer.model
    with tf.device("/device:CPU:0"):
        values = [tf.constant(w) for w in weights]
        state = [v.value() for v in trainer.copies[0].non_trainable]
        with tf.GradientTape() as tape:
            tape.watch(values)
            outputs, _ = model.stateless_call(values, state, tf.constant(x))
            loss = tf.reduce_mean(trainer.loss_fn(tf.constant(y), outputs))
        return [g.numpy() for g in tape.gradient(loss, values)]


def test_delay_one_computes_on_the_previous_steps_parameters(logdir):
    """delay:d=1 on 2 towers: at step s each tower's gradient is the gradient of its shard's
    mean loss at v(s - 1) (v(0) at step 0), computed apart. The same ops on the same
    kind of device: equal to a few roundings of each element's magnitude (tolerance
    below); the gradient at the current parameters v(s) is asserted to lie far outside it,
    so a read of the wrong snapshot fails."""
    config = helpers.small_config(logdir, devices="cpu:2", aggregation="delay:d=1",
                                  optimizer="sgd", learning_rate=0.5)
    keeper = KeepTowerGradients()
    trainer = build(config, hooks=[keeper])
    history = [helpers.copy_weights(trainer)[0]]  # v(0), v(1), ...
    half = helpers.GLOBAL_BATCH // 2
    for s, (x, y) in enumerate(helpers.batches(4)):
        helpers.run_batches(trainer, [(x, y)])
        history.append(helpers.copy_weights(trainer)[0])
        for t in range(2):
            shard = slice(t * half, (t + 1) * half)
            got = [v.numpy() for v in keeper.kept[t]]
            stale = gradient_apart(trainer, history[max(s - 1, 0)], x[shard], y[shard])
            current = gradient_apart(trainer, history[s], x[shard], y[shard])
            for g, want, now in zip(got, stale, current):
                allowed = 64 * U * (np.abs(want).max() + 1e-30)
                np.testing.assert_allclose(g, want, rtol=0, atol=allowed)
                if s >= 1:  # v(s) != v(s-1): the current parameters' gradient differs
                    assert np.abs(now - want).max() > 100 * allowed or not now.any()


def test_drop_leaves_out_one_tower_and_averages_the_rest(logdir):
    """drop:k=1 on 4 towers, hand-made tower gradients g_t = (t + 1) * c: each call's result
    is the mean of 3 towers' (the sums exact: small integers times c; the means without
    different towers lie >= c/3 apart), the one left out is found from it, and the seeded
    draws are reproducible and not always the same tower; by arrival order, too, one
    tower is left out and the others averaged."""
    config = helpers.small_config(logdir, devices="cpu:4").validated()
    from mgloop.cluster import devices
    device_set = devices.setup(devices.parse(config.devices, config.towers_per_device))

    def draws(seed, choose="seeded"):
        method = aggregation.make(f"drop:k=1,seed={seed},choose={choose}", device_set)
        variables = [tf.Variable(tf.zeros([3]))]
        method.build(variables)
        base = np.array([1.0, 2.0, 4.0], np.float32)
        dropped = []
        for _ in range(12):
            placed = []
            for t, device in enumerate(device_set.towers):
                with tf.device(device):
                    placed.append([tf.constant(base * (t + 1))])
            out = method.reduce(placed, variables)
            assert len(out) == 1
            got = out[0][0].numpy()
            means = [np.float32(sum(u + 1 for u in range(4) if u != t)) * base / 3
                     for t in range(4)]  # the mean without tower t
            left_out = int(np.argmin([np.abs(got - m).max() for m in means]))
            # exact sums of small integers times c, one rounding of the scaling by 1/3
            np.testing.assert_allclose(got, means[left_out], rtol=2 * U, atol=0)
            dropped.append(left_out)
        return dropped

    first = draws(0)
    assert draws(0) == first  # seeded
    assert len(set(first)) > 1  # a draw per step, not one tower forever
    assert draws(1) != first
    # a clock read is refused under op determinism (on in this process: --deterministic);
    # TensorFlow's public API can only turn it on, so its own switch turns it off here
    determinism = tf_config.is_op_determinism_enabled()
    tf_config.disable_op_determinism()
    try:
        draws(0, "arrival")  # one tower (the last to finish) left out, the others' mean
    finally:
        if determinism:
            tf.config.experimental.enable_op_determinism()


@pytest.mark.parametrize("slots", ["keep", "average"])
def test_local_sgd_replicas_diverge_between_syncs_and_meet_at_them(slots, logdir):
    """localsgd:period=2 on 2 towers: the replica divergence diagnostic is > 0 after steps
    1 and 3 and exactly 0 after steps 2 and 4 (the saw-tooth); the optimizer slots are
    equal right after a sync with slots=average and differ with slots=keep."""
    config = helpers.small_config(logdir, devices="cpu:2",
                                  aggregation=f"localsgd:period=2,slots={slots}")
    trainer = helpers.build_trainer(config)
    seen = []
    for batch in helpers.batches(4):
        helpers.run_batches(trainer, [batch])
        seen.append(float(diagnostics.replica_divergence(trainer.copies)))
        first, second = trainer.copies
        slots_equal = all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(
            first.optimizer.variables, second.optimizer.variables))
        if len(seen) % 2 == 0:
            assert slots_equal == (slots == "average")
    assert seen[0] > 1e-4 and seen[2] > 1e-4
    assert seen[1] == 0.0 and seen[3] == 0.0


def test_diloco_outer_step(logdir):
    """diloco:period=2 (outer_lr 0.7, Nesterov momentum 0.9): after 2 steps every copy holds
    x = x0 - 0.7 (delta + 0.9 m), m = delta = x0 - a, a the mean of the copies after 2
    local steps (those of localsgd with no sync yet: the same inner steps). Within
    8 roundings of the magnitudes involved."""
    batches = helpers.batches(2)
    config = helpers.small_config(logdir, devices="cpu:2", aggregation="diloco:period=2")
    outer = helpers.build_trainer(config)
    start = helpers.copy_weights(outer)[0]
    helpers.run_batches(outer, batches)
    local, _ = helpers.train_mgloop(dataclasses.replace(
        config, aggregation="localsgd:period=100"), batches)
    copies = helpers.copy_weights(local)
    for i, x0 in enumerate(start):
        a = np.mean([c[i] for c in copies], axis=0, dtype=np.float64)
        delta = x0 - a
        want = x0 - 0.7 * (delta + 0.9 * delta)
        allowed = 8 * U * (np.abs(x0) + np.abs(a) + 2 * np.abs(delta))
        for c in helpers.copy_weights(outer):
            assert np.all(np.abs(c[i] - want) <= allowed)
        assert np.abs(delta).max() > 1e-4  # the replicas moved: a real outer step


def checkpoint_tensors(logdir):
    """{key: value} of every variable in the latest checkpoint of a run's logdir (not the
    count of saves nor the object graph)."""
    reader = tf.train.load_checkpoint(os.path.join(logdir, "checkpoints"))
    return {key: reader.get_tensor(key) for key in reader.get_variable_to_dtype_map()
            if not key.startswith(("save_counter", "_CHECKPOINTABLE_OBJECT_GRAPH"))}


def test_resume_mid_period_is_bit_identical(tmp_path):
    """diloco:period=4 on 2 towers (mgloop.run): 6 steps straight equal 3 steps (checkpoint
    mid-period, the copies apart), then a resumed run of 3 more (the outer step closing
    step 4 after the resume), bit for bit under --deterministic: every tensor of the last
    checkpoint (every copy, its optimizer, the method's x and m, the step)."""
    def run(name, steps):
        return mgloop.run(helpers.small_config(
            str(tmp_path / name), devices="cpu:2", aggregation="diloco:period=4",
            train_steps=steps, steps_per_loop=3, checkpoint_every=0, eval_every=0))
    run("straight", 6)
    assert run("resumed", 3)["final_step"] == 3
    assert run("resumed", 6)["start_step"] == 3
    straight, resumed = (checkpoint_tensors(tmp_path / n) for n in ("straight", "resumed"))
    assert any(k.startswith("replicas/") for k in straight)  # the copies are saved
    assert any(k.startswith("aggregation_state/diloco/") for k in straight)
    assert straight.keys() == resumed.keys()
    for key, value in straight.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)
