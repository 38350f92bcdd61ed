"""--batch_norm: which batch statistics the towers normalise with, and which moving
statistics end up in the template model and its export.

    per_tower  moving mean m' = mu m + (1 - mu) (1/T) sum_t mean(shard t), variance
               likewise with the shards' (biased) variances: checked against numpy.
    sync       the statistics of the global batch, so N towers equal one device on the
               global batch, weights and moving statistics alike.

Tolerance: trainable weights within the bound of tests/tolerance.py, computed along the
one-device run (as in test_equivalence.py; BatchNormBound adds the terms of the Dense
bias in front of the batch norm, whose gradient is 0 in exact arithmetic). Moving
statistics per tower are checked against their exact (float64) values within
tolerance.MovingMomentsBound (the Dense output's dot products, each shard's mean and
variance, their average and the moving update, in float32). The moving statistics of
the sync and accumulation tests are compared with another float32 run (the one-device
reference), whose weights differ from the towers' by at most the trainable bound dW
(a running sum, so its final value bounds every earlier step's): the reference is
within MovingMomentsBound of the exact statistics at its weights, the towers within
the same bound with h's change |x| dW + db added (tolerance.MovingMomentsBound's
`weight_bound`); the tolerance is the sum of the two (moving_statistics_bound).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from mgloop.runs import experiment, export
from mgloop.training import optim
from mgloop.step.hooks.synced_moments import SyncBatchNorm
from tests import helpers
from tests import tolerance

STEPS = 3
DENSE, NORM = 1, 2  # layer indices in bn_model


def bn_model():
    return keras.Sequential([
        keras.Input(helpers.DATASET.input_shape), keras.layers.Flatten(),
        keras.layers.Dense(16), keras.layers.BatchNormalization(momentum=0.5),
        keras.layers.Activation("relu"), keras.layers.Dense(10)])


def exported_statistics(model, export_dir):
    """(moving mean, moving variance) of the batch norm in the saved and reloaded template."""
    path = export.export_model(model, export_dir)
    loaded = keras.models.load_model(path).layers[NORM]
    assert loaded._moments.__func__ is keras.layers.BatchNormalization._moments  # plain Keras
    return loaded.moving_mean.numpy(), loaded.moving_variance.numpy()


class BatchNormBound(tolerance.StepBound):
    """tests/tolerance.py's bound, and for the Dense bias b in front of the batch norm,
    whose gradient sum_j dL/dh_j is 0 in exact arithmetic for every example (the
    normalisation subtracts the batch mean) yet is summed from non-zero terms: with
    y = gamma xhat + beta, xhat_j = (h_j - mean h) / s, s = sqrt(var h + eps),
    dL/dh_j = (gamma / s) (dy_j - mean dy - xhat_j mean(dy xhat)), so
    sum_j |dL/dh_j| <= 3 (|gamma| / s) sum_j |dy_j|, and through the ReLU and the
    output kernel V, sum_j |dy_jk| <= (1/B) sum_j sum_c |V_kc| |p_jc - onehot_jc|
    <= 2 sum_c |V_kc| (softmax and one-hot differ by at most 2 in 1-norm)."""

    def term_magnitudes(self, model, x, y):
        kernel, bias = (v.numpy().astype(np.float64) for v in model.layers[DENSE].weights)
        norm = model.layers[NORM]
        h = np.reshape(x.numpy(), (x.shape[0], -1)).astype(np.float64) @ kernel + bias
        s = np.sqrt(h.var(axis=0) + norm.epsilon)
        out_kernel = np.abs(model.layers[-1].kernel.numpy().astype(np.float64))
        terms = 3 * np.abs(norm.gamma.numpy()) / s * 2 * out_kernel.sum(axis=1)
        return {1: terms}  # variable 1: the Dense bias

    def before(self, model, optimizer, loss_fn, x, y, micro_batches=1):
        """Also records each step's batch, Dense weights and micro-batch count."""
        if not hasattr(self, "steps"):
            self.steps = []
        kernel, bias = (v.numpy() for v in model.layers[DENSE].weights)
        self.steps.append((np.asarray(x), kernel, bias, micro_batches))
        super().before(model, optimizer, loss_fn, x, y, micro_batches)

    def moving_statistics_bound(self, momentum):
        """Bound on |moving (mean, variance) of a float32 run whose weights lie within
        weights() of this run's - this run's float32 values| (module docstring): each
        micro-batch normalised over all its rows (groups=1: the global batch's statistics,
        whatever order the towers sum them in)."""
        moved = tuple(self.weights()[:2])  # the Dense kernel's and bias's bounds
        here = tolerance.MovingMomentsBound(momentum, 16)
        there = tolerance.MovingMomentsBound(momentum, 16)
        for x, kernel, bias, micro_batches in self.steps:
            for xk in np.split(x, micro_batches):
                here.update(xk, kernel, bias, groups=1)
                there.update(xk, kernel, bias, groups=1, weight_bound=moved)
        return [here.mean_bound + there.mean_bound,
                here.variance_bound + there.variance_bound]


@pytest.mark.parametrize("mode,towers", [("ring", 2), ("ring", 4), ("ps_cpu", 4),
                                         ("collective", 4)])
def test_sync_equals_one_device_on_the_global_batch(mode, towers, tmp_path):
    config = helpers.small_config(str(tmp_path / "run"), devices=f"cpu:{towers}",
                                  aggregation=mode, batch_norm="sync")
    trainer = helpers.build_trainer(config, bn_model)
    helpers.run_batches(trainer, helpers.batches(STEPS))
    bound = BatchNormBound()
    reference, _ = helpers.train_reference_model(config, helpers.batches(STEPS), bn_model, bound)
    norm = reference.layers[NORM]
    statistics = [norm.moving_mean.numpy(), norm.moving_variance.numpy()]
    statistics_bound = bound.moving_statistics_bound(norm.momentum)
    for copy in trainer.copies:
        tolerance.assert_within([v.numpy() for v in copy.trainable],
                                [v.numpy() for v in reference.trainable_variables],
                                bound.weights())
        tolerance.assert_within([v.numpy() for v in copy.non_trainable], statistics,
                                statistics_bound)
    assert np.abs(norm.moving_variance.numpy() - 1).max() > 0.1  # the statistics moved
    exported = exported_statistics(trainer.model, str(tmp_path / "export"))
    tolerance.assert_within(list(exported), statistics, statistics_bound)


@pytest.mark.parametrize("mode,towers", [("ring", 4), ("ps_cpu", 2)])
def test_per_tower_statistics_are_the_mean_of_the_shard_statistics(mode, towers, tmp_path):
    config = helpers.small_config(str(tmp_path / "run"), devices=f"cpu:{towers}",
                                  aggregation=mode)
    trainer = helpers.build_trainer(config, bn_model)
    momentum = trainer.model.layers[NORM].momentum
    exact = tolerance.MovingMomentsBound(momentum, 16)  # float64 values, float32 bound
    global_variance = np.ones(16)
    for x, y in helpers.batches(STEPS):
        kernel, bias = (v.numpy() for v in trainer.copies[0].trainable[:2])
        exact.update(x, kernel, bias, groups=towers)
        dense = x.reshape(len(x), -1).astype(np.float64) @ kernel + bias  # the Dense outputs
        global_variance = momentum * global_variance + (1 - momentum) * dense.var(0)
        helpers.run_batches(trainer, [(x, y)])
        for copy in trainer.copies:
            tolerance.assert_within([v.numpy() for v in copy.non_trainable[:2]],
                                    [exact.mean, exact.variance],
                                    [exact.mean_bound, exact.variance_bound])
    # Per-shard variances miss the spread of the shard means: not the global statistics
    # (far outside the bound).
    assert np.abs(exact.variance - global_variance).max() > 1e-2
    assert np.abs(exact.variance - global_variance).max() > 100 * exact.variance_bound.max()
    exported = exported_statistics(trainer.model, str(tmp_path / "export"))
    tolerance.assert_within(list(exported), [exact.mean, exact.variance],
                            [exact.mean_bound, exact.variance_bound])


def test_sync_with_accumulation_equals_one_device_accumulating(tmp_path):
    """2 towers, sync, 2 micro-batches of 8 per step: one device normalising each
    micro-batch of 8 and averaging their gradients (the collectives run in the
    accumulation loop, once per micro-batch)."""
    config = helpers.small_config(str(tmp_path / "run"), devices="cpu:2", aggregation="ring",
                                  batch_norm="sync", global_batch_size=8, accumulation_steps=2)
    batches = helpers.batches(STEPS)  # 16 examples a step: 2 micro-batches of 8
    trainer = helpers.build_trainer(config, bn_model)
    helpers.run_batches(trainer, batches)

    experiment.seed_everything(config.seed, True)
    bound = BatchNormBound()
    with tf.device("/device:CPU:0"):
        model = bn_model()
        resolved = config.validated()
        optimizer = optim.make_optimizer(resolved.optim, resolved.train_steps)
        loss_fn = experiment.default_loss()
        for x, y in batches:
            bound.before(model, optimizer, loss_fn, tf.constant(x), tf.constant(y),
                         micro_batches=2)
            sums = None
            for xk, yk in zip(np.split(x, 2), np.split(y, 2)):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(loss_fn(yk, model(xk, training=True)))
                grads = tape.gradient(loss, model.trainable_variables)
                sums = grads if sums is None else [s + g for s, g in zip(sums, grads)]
            optimizer.apply([s / 2 for s in sums], model.trainable_variables)
            bound.after()
    tolerances = bound.weights() + bound.moving_statistics_bound(model.layers[NORM].momentum)
    for copy in trainer.copies:
        tolerance.assert_within([v.numpy() for v in copy.variables],
                                [v.numpy() for v in model.trainable_variables +
                                 model.non_trainable_variables], tolerances)


def test_sync_hooks_the_template_only(tmp_path):
    config = helpers.small_config(str(tmp_path / "run"), devices="cpu:2", batch_norm="sync")
    trainer = helpers.build_trainer(config, bn_model)
    own = keras.layers.BatchNormalization._moments
    assert getattr(trainer.model.layers[NORM]._moments, "__func__", None) is not own
    assert bn_model().layers[NORM]._moments.__func__ is own  # other models are untouched
    one_tower = helpers.build_trainer(helpers.small_config(str(tmp_path / "one"),
                                                           batch_norm="sync"), bn_model)
    # one tower: its statistics are the global ones, no synchronising hook
    assert one_tower.step.hooks.find(SyncBatchNorm) is None
    assert trainer.step.hooks.find(SyncBatchNorm) is not None
