"""--mixed_precision: 16-bit compute equals the single device under the same policy, and
the dynamic loss scale skips an overflowing step on every copy.

Tolerance of one step (derived, not picked). From the same weights, the towers and
the single device compute every per-example forward and backward value identically
in 16 bits: the per-tower losses are means over B/T instead of B examples and the
loss is scaled by 2**15, both powers of two, which change no mantissa. The only
batch-dependent values are the weight gradients, sums over examples that each side
rounds to 16 bits once: the single device sums all B examples (error <= u |S| per
element), each tower its shard (error <= u |S_t|, S = sum_t S_t), and the towers'
results are averaged in float32. So, with u the unit roundoff (float16, 11-bit
significand: 2**-11; bfloat16, 8-bit: 2**-8), g the gradient of the mean loss and
g_t tower t's gradient on its shard,

    ||g_mgloop - g_reference|| <= u (||g|| + (1/T) sum_t ||g_t||)

plus float32 rounding of w - lr g on both sides (<= 2 * 2**-24 ||w||). The test
compares updates step by step from the same weights (the reference is reset to
mgloop's weights before each step): over several free-running steps the 16-bit
rounding of float32 weights that differ by u |update| makes whole 16-bit ulps of
|w| >> |update| differ, which no rounding bound covers.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from mgloop.runs import checkpoint, experiment, export
from mgloop.training import optim
from mgloop.step import precision
from tests import helpers
from third_party import single_device

UNIT_ROUNDOFF = {"mixed_float16": 2.0 ** -11, "mixed_bfloat16": 2.0 ** -8}
FLOAT32_ROUNDOFF = 2.0 ** -24
SCALE = 2.0 ** 15


def flat(values):
    return np.concatenate([np.asarray(v).ravel() for v in values])


def gradient_norms(model, x, y, towers):
    """(||g||, (1/T) sum_t ||g_t||): the gradient of the mean loss on the batch and on its shards."""
    loss_fn = experiment.default_loss()

    def gradient(xs, ys):
        with tf.GradientTape() as tape:
            logits = tf.cast(model(xs, training=True), tf.float32)
            scaled = tf.reduce_mean(loss_fn(ys, logits)) * SCALE  # no underflow in float16
        return flat([g.numpy() for g in tape.gradient(scaled, model.trainable_variables)]) / SCALE

    shards = [np.linalg.norm(gradient(xs, ys))
              for xs, ys in zip(np.split(x, towers), np.split(y, towers))]
    return np.linalg.norm(gradient(x, y)), float(np.mean(shards))


def reference_step(config, policy):
    """A single-device model under `policy` and its training step (the Keras guide's loop)."""
    with tf.device("/device:CPU:0"):
        with precision.policy_scope(policy):
            model = helpers.model_fn(config.model)()
        resolved = config.validated()
        optimizer = optim.make_optimizer(resolved.optim, resolved.train_steps)
        if precision.uses_loss_scaling(policy):
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        step = single_device.make_mixed_precision_train_step(model, experiment.default_loss(),
                                                             optimizer)
        optimizer.build(model.trainable_variables)  # as its first apply would: one trace
    return model, step


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("mode,towers", [("ring", 4), ("ps_cpu", 2)])
def test_each_step_equals_single_device_under_the_same_policy(policy, mode, towers, logdir):
    config = helpers.small_config(logdir, devices=f"cpu:{towers}", aggregation=mode,
                                  mixed_precision=policy, optimizer="sgd")
    trainer = helpers.build_trainer(config)
    reference, step = reference_step(config, policy)
    full_precision, full_step = reference_step(config, "none")
    u = UNIT_ROUNDOFF[policy]
    for x, y in helpers.batches(3):
        before = [v.numpy() for v in trainer.copies[0].trainable]
        for model in (reference, full_precision):
            for variable, value in zip(model.trainable_variables, before):
                variable.assign(value)
        g, shards = gradient_norms(reference, x, y, towers)
        step(tf.constant(x), tf.constant(y))
        full_step(tf.constant(x), tf.constant(y))
        expected = flat(reference.trainable_variables) - flat(before)
        float32_update = flat(full_precision.trainable_variables) - flat(before)
        helpers.run_batches(trainer, [(x, y)])
        float32_slack = 2 * FLOAT32_ROUNDOFF * np.linalg.norm(flat(before)) / np.linalg.norm(
            expected)
        bound = u * (1 + shards / g) + float32_slack  # ~2.3-3 u here; measured ~0.6 u
        for copy in helpers.copy_weights(trainer):
            actual = flat(copy) - flat(before)
            error = np.linalg.norm(actual - expected) / np.linalg.norm(expected)
            assert error <= bound, (error / u, bound / u)
            # 16-bit compute happened: 10x farther from the float32 update than float32
            # rounding alone could put it (measured: >= 100x).
            away = np.linalg.norm(actual - float32_update) / np.linalg.norm(float32_update)
            assert away > 10 * float32_slack
    assert trainer.loss_scale() == (SCALE if policy == "mixed_float16" else None)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_template_is_built_under_the_policy_and_the_global_policy_restored(policy, tmp_path):
    trainer = helpers.build_trainer(helpers.small_config(str(tmp_path / "run"), devices="cpu:2",
                                                         mixed_precision=policy))
    assert keras.config.dtype_policy().name == "float32"
    assert helpers.model_fn("mlp")().layers[-1].compute_dtype == "float32"
    compute = policy.removeprefix("mixed_")
    assert [layer.compute_dtype for layer in trainer.model.layers] == [compute] * 3  # 2 Dense
    assert {v.dtype for v in trainer.model.weights} == {"float32"}
    path = export.export_model(trainer.model, str(tmp_path / "export"))
    loaded = keras.models.load_model(path)
    assert [layer.dtype_policy.name for layer in loaded.layers] == [policy] * 3


def poison_tower(x, towers, tower, factor):
    """The batch with tower `tower`'s shard multiplied by `factor`."""
    x = x.copy()
    shard = len(x) // towers
    x[tower * shard:(tower + 1) * shard] *= factor
    return x


def loss_scales(trainer):
    return [float(s.scale.numpy()) for s in trainer.loss_scales]


@pytest.mark.parametrize("mode,towers,nodes", [("ring", 2, 1), ("ps_cpu", 4, 1),
                                               ("independent", 4, 1), ("colocate", 2, 1),
                                               ("topk:ratio=0.25", 4, 2)])
def test_overflow_on_one_tower_skips_the_update_on_every_copy(mode, towers, nodes, logdir):
    """Tower 1's inputs x30: the forward pass stays finite in float16, the backward at scale
    2**15 overflows. `independent` shares no gradient: only the agreed flag stops the
    other replicas, whose own gradients are finite. `colocate`: its one loss on the host.
    With 2 simulated nodes the overflow is in node 0 only, and node 1 skips too (between
    real workers: tests/test_nodes_workers.py, an overflow on worker 1 only)."""
    config = helpers.small_config(logdir, devices=f"cpu:{towers}", aggregation=mode,
                                  nodes=nodes, mixed_precision="mixed_float16")
    trainer = helpers.build_trainer(config)
    (x, y), = helpers.batches(1)
    before = helpers.copy_weights(trainer)
    loss = helpers.run_batches(trainer, [(poison_tower(x, towers, 1, 30.0), y)])
    assert np.isfinite(loss)  # the overflow is in the scaled backward pass
    for copy, copy_before in zip(helpers.copy_weights(trainer), before):
        for a, b in zip(copy, copy_before):
            np.testing.assert_array_equal(a, b)
    assert [int(c.optimizer.iterations.numpy()) for c in trainer.copies] == [0] * len(before)
    assert loss_scales(trainer) == [SCALE / 2] * len(before)
    assert int(trainer.global_step.numpy()) == 1  # the step consumed its batch

    helpers.run_batches(trainer, [(x, y)])  # a normal step updates again, at the lower scale
    after = helpers.copy_weights(trainer)
    for copy, copy_before in zip(after, before):
        assert max(np.abs(a - b).max() for a, b in zip(copy, copy_before)) > 1e-4
    assert [int(c.optimizer.iterations.numpy()) for c in trainer.copies] == [1] * len(before)
    assert trainer.loss_scale() == SCALE / 2
    if mode == "ring":
        for a, b in zip(after[0], after[1]):
            np.testing.assert_array_equal(a, b)


def test_scale_doubles_after_the_growth_interval(monkeypatch, logdir):
    monkeypatch.setattr(precision, "GROWTH_INTERVAL", 3)  # read when the step is traced
    trainer = helpers.build_trainer(helpers.small_config(
        logdir, devices="cpu:2", aggregation="ring", mixed_precision="mixed_float16"))
    helpers.run_batches(trainer, helpers.batches(4))
    assert loss_scales(trainer) == [2 * SCALE] * 2  # doubled after the 3rd finite step
    assert [int(s.finite_steps.numpy()) for s in trainer.loss_scales] == [1, 1]


def test_loss_scale_is_checkpointed_and_synced_to_every_replica(tmp_path):
    def build():
        trainer = helpers.build_trainer(helpers.small_config(
            str(tmp_path / "run"), devices="cpu:4", aggregation="ring",
            mixed_precision="mixed_float16"))
        return trainer, checkpoint.Checkpointer(
            str(tmp_path / "checkpoints"), trainer.model, trainer.copies[0].optimizer,
            trainer.global_step, keep=1)

    saved, saver = build()
    saved.loss_scales[0].scale.assign(1024.0)
    saved.loss_scales[0].finite_steps.assign(7)
    saver.save(1)
    restored, restorer = build()
    assert restorer.restore_latest()
    restored.sync_replicas()
    assert loss_scales(restored) == [1024.0] * 4
    assert [int(s.finite_steps.numpy()) for s in restored.loss_scales] == [7] * 4


@pytest.mark.parametrize("method", ["topk:ratio=0.25", "powersgd:rank=1"])
def test_a_skipped_step_leaves_the_methods_state_untouched(method, logdir):
    """A stateful method (error-feedback residuals, PowerSGD's Q, the exchange counter)
    under loss scaling: the overflowing step leaves every state variable bit-identical
    (hooks/loss_scaling.py: written back after the exchange); the next, finite step
    changes it. Before, the residual took the step's inf/NaN and sent it on forever."""
    config = helpers.small_config(logdir, devices="cpu:2", aggregation=method,
                                  mixed_precision="mixed_float16")
    trainer = helpers.build_trainer(config)
    state = trainer.replicas.aggregation.state_variables
    assert state, f"{method} has state to keep"
    (x, y), = helpers.batches(1)
    before = [v.numpy() for v in state]
    helpers.run_batches(trainer, [(poison_tower(x, 2, 1, 30.0), y)])
    assert loss_scales(trainer) == [SCALE / 2] * len(trainer.copies)  # the step was skipped
    for v, b in zip(state, before):
        np.testing.assert_array_equal(v.numpy(), b, err_msg=v.name)
    helpers.run_batches(trainer, [(x, y)])
    after = [v.numpy() for v in state]
    assert all(np.isfinite(a).all() for a in after)
    assert any(not np.array_equal(a, b) for a, b in zip(after, before))
