"""--optimizer=muon: Keras's own Muon, on one device and on every copy (mgloop/training/muon.py).

(a) One device equals the Keras loop (third_party/single_device.py) with Keras's Muon, bit for bit.
(b) On 2 towers (the ring) no float32 bound covers Muon: tolerance.StepBound carries a
    gradient's rounding through SGD, momentum and Adam, not through 5 Newton-Schulz
    iterations, whose gain on a change of the gradient is unbounded as the momentum matrix
    nears a singular one (the quintic's slope at 0 is 3.4445 per iteration, after a division
    by ||G||_F); a first-order propagation with a measured Lipschitz constant would be a fit.
    So the claim is split in two, each exact or bounded: the run is Keras's Muon applied to
    the gradients the copies received, bit for bit (replayed from the same start), and each
    step's mean gradient lies within tolerance.py's gradient bound (1.) of the one-device
    gradient at the same weights, its terms' magnitudes taken from the mlp's absolute
    passes (tolerance.dense_chain_terms: |g_i| understates them).
(c) The AdamW part is the same on every copy (copy 1's variables are "replica_1/..."), for
    the mlp, cnn and transformer_lm: Keras's rule plus the output layer; a user's Muon
    anchored to the template's paths holds on every copy; a build that splits by its own
    rule is refused in one line.
(d) Refused in one line: --shard_update, DeMo, Muon's settings with another optimizer, a
    model whose output layer is not traced, a user's Muon with --shard_update.
MuLoCo (DiLoCo with Muon inside) at --nodes=4 trains; DiLoCo's identity setting is then the
mean of the nodes' Muon steps (localsgd:period=1), not the ring's Muon of the mean gradient.
"""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from mgloop import models
from mgloop.cluster import devices
from mgloop.errors import ConfigError
from mgloop.runs import experiment
from mgloop.step.hooks import Hook
from mgloop.training import optim
from mgloop.training.muon import adamw_part
from tests import helpers, tolerance
from third_party import single_device

STEPS, LR, MU, DECAY = 3, 0.02, 0.95, 0.1


def muon_config(logdir, **overrides):
    settings = dict(optimizer="muon", learning_rate=LR, momentum=MU, weight_decay=DECAY,
                    train_steps=STEPS, steps_per_loop=STEPS)
    settings.update(overrides)
    return helpers.small_config(logdir, **settings)


def keras_muon(model):
    """Keras's Muon of muon_config's settings, as a user writes it: the output layer's kernel
    given to AdamW by its path."""
    return keras.optimizers.Muon(LR, momentum=MU, epsilon=1e-7, weight_decay=DECAY,
                                 adam_weight_decay=DECAY, adam_lr_ratio=1.0, rms_rate=0.2,
                                 exclude_layers=[re.escape(model.layers[-1].kernel.path)])


def same_bits(first, *others):
    return all(np.array_equal(a, b) for other in others for a, b in zip(first, other))


def split_of(copy):
    """Whether copy's optimizer gives each of its variables to the AdamW part (a velocity)."""
    velocities, index = copy.optimizer.adam_velocities, copy.optimizer._get_variable_index
    return [velocities[index(v)] is not None for v in copy.trainable]


def trainer_of(config, make_model=None, optimizer=None, hooks=(), input_shape=None):
    settings = config.validated()
    return experiment.build_trainer(settings, devices.setup(devices.parse(settings.devices)),
                                    make_model or helpers.model_fn("mlp"),
                                    experiment.default_loss(),
                                    input_shape or helpers.DATASET.input_shape,
                                    optimizer=optimizer, hooks=hooks)


def test_one_device_equals_keras_own_muon_loop_bit_for_bit(logdir):
    trainer = helpers.build_trainer(muon_config(logdir, devices="cpu:1"))
    initial, steps = helpers.copy_weights(trainer)[0], helpers.batches(STEPS)
    helpers.run_batches(trainer, steps)
    with tf.device("/device:CPU:0"):
        model = helpers.model_fn("mlp")()
        model.set_weights(initial)
        step = single_device.make_train_step(model, experiment.default_loss(), keras_muon(model))
        for x, y in steps:
            step(tf.constant(x), tf.constant(y))
    names = [v.name for v in trainer.copies[0].trainable]
    for name, got, want in zip(names, helpers.copy_weights(trainer)[0], model.get_weights()):
        assert np.array_equal(got, want), f"{name}: {np.abs(got - want).max():.3g} apart"
    assert split_of(trainer.copies[0]) == [False, True, True, True]  # the hidden kernel


class KeepExchanged(Hook):
    """Keeps every copy's exchanged gradients of the last step (what its optimizer applies)."""
    kept = None

    def after_exchange(self, grads):
        if self.kept is None:
            with tf.init_scope():
                self.kept = [[tf.Variable(tf.zeros(g.shape, g.dtype), trainable=False)
                              for g in copy] for copy in grads]
        return [k.assign(g) for kept, copy in zip(self.kept, grads) for k, g in zip(kept, copy)]


def test_two_towers_apply_keras_muon_to_their_mean_gradient_within_its_bound(logdir):
    kept = KeepExchanged()
    trainer = trainer_of(muon_config(logdir, devices="cpu:2", aggregation="ring"), hooks=[kept])
    initial, loss_fn = helpers.copy_weights(trainer)[0], experiment.default_loss()
    reference = helpers.model_fn("mlp")()
    received = []
    for x, y in helpers.batches(STEPS):
        reference.set_weights(helpers.copy_weights(trainer)[0])  # the run's weights before
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(tf.constant(y), reference(tf.constant(x))))
        one_device = np.concatenate([g.numpy().ravel() for g in
                                     tape.gradient(loss, reference.trainable_variables)])
        terms = tolerance.StepBound()  # the mlp's absolute passes (tolerance.py 1.)
        terms.before(reference, None, loss_fn, tf.constant(x), tf.constant(y))
        bound = np.concatenate([d.ravel() for d in terms.last[0]])
        helpers.run_batches(trainer, [(x, y)])
        copies = [[v.numpy() for v in copy] for copy in kept.kept]
        assert same_bits(*copies)  # the ring: every copy the same bits of the mean
        tolerance.assert_within([np.concatenate([g.ravel() for g in copies[0]])],
                                [one_device], [bound])
        received.append(copies[0])
    with tf.device("/device:CPU:0"):  # Keras's Muon on the gradients the copies received
        model = helpers.model_fn("mlp")()
        model.set_weights(initial)
        optimizer = keras_muon(model)
        apply = tf.function(lambda grads: optimizer.apply_gradients(
            zip(grads, model.trainable_variables)))
        for grads in received:
            apply([tf.constant(g) for g in grads])
    assert same_bits(model.get_weights(), *helpers.copy_weights(trainer))


@pytest.mark.parametrize("name,make,shape,muon_count", [
    ("mlp", helpers.model_fn("mlp"), None, 1),  # the kernel before the output layer
    ("cnn", lambda: models.get("cnn")((8, 8, 3), 10), (8, 8, 3), 0),  # 4-D kernels: AdamW
    # its 2 blocks' feed-forward kernels (attention's projections are 3-D)
    ("transformer_lm", lambda: models.get("transformer_lm")((8,), 16), (8,), 4)])
def test_the_adamw_part_is_the_same_on_every_copy(name, make, shape, muon_count, logdir):
    config = muon_config(logdir, devices="cpu:2", aggregation="ring")
    trainer = trainer_of(config, make, input_shape=shape)
    template = trainer.model.trainable_variables
    output = trainer.model.layers[-1].kernel.path
    # copy 0 is the template's variables, named by their paths (what muon.adamw_part reads)
    assert [v.name.split(":")[0] for v in trainer.copies[0].trainable] == [v.path for v in template]
    keras_rule = [len(v.shape) != 2 or "embedding" in v.path.lower() or v.path == output
                  for v in template]
    assert trainer.copies[1].trainable[0].name.startswith("replica_1/")
    for copy in trainer.copies:
        assert split_of(copy) == keras_rule
    assert keras_rule.count(False) == muon_count
    # Keras's own rule on a clone's path, untold, decides as on the template's path (the
    # output's pattern is not anchored at ^)
    untold = optim.FlagOptimizer(config.optim, STEPS).for_model(trainer.model)()
    assert adamw_part(untold, trainer.copies[1].trainable) == keras_rule


def template_mlp():
    experiment.seed_everything(3, True)  # the run's seed: the template starts as the run's
    return helpers.model_fn("mlp")()


@pytest.mark.parametrize("given", ["object", "factory"])
def test_a_users_muon_anchored_to_the_templates_paths_holds_on_every_copy(given, logdir):
    template = template_mlp()
    hidden = template.trainable_variables[0].path  # "mlp/dense/kernel": copy 1's does not match

    def anchored():
        return keras.optimizers.Muon(LR, exclude_layers=["^" + re.escape(hidden)])
    trainer = trainer_of(muon_config(logdir, devices="cpu:2", aggregation="ring"),
                         lambda: template, anchored() if given == "object" else anchored)
    assert re.search("^" + re.escape(hidden), trainer.copies[1].trainable[0].name) is None
    for copy in trainer.copies:  # the first kernel and every non-matrix: AdamW, on every copy
        # (the user's Muon, not the flags': its output kernel is Muon's, as Keras would have it)
        assert split_of(copy) == [True, True, False, True]
    helpers.run_batches(trainer, helpers.batches(2))
    assert same_bits(*helpers.copy_weights(trainer))


class SplitsByName(keras.optimizers.Muon):
    """A build of its own: a velocity (the AdamW part) for every variable named replica_*."""

    def build(self, var_list):
        super().build(var_list)
        for v in var_list:
            index = self._get_variable_index(v)
            if v.name.startswith("replica_") and self.adam_velocities[index] is None:
                self.adam_velocities[index] = self.add_variable_from_reference(v, "velocity")


def test_a_muon_whose_build_splits_by_its_own_rule_is_refused(logdir):
    with pytest.raises(ConfigError, match="SplitsByName's build decides which variables its "
                       "AdamW part takes by a rule of its own") as error:
        trainer_of(muon_config(logdir, devices="cpu:2", aggregation="ring"),
                   optimizer=lambda: SplitsByName(LR))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("overrides,pattern", [
    (dict(devices="cpu:2", aggregation="ring", shard_update=True),
     r"--shard_update with --optimizer=muon: .*a chunk's Newton-Schulz is not the matrix's"),
    (dict(devices="cpu:2", aggregation="demo"),
     r"--aggregation=demo applies momentum itself, so --optimizer=muon would apply a second"),
    (dict(optimizer="adam", muon_rms_rate=0.5),
     r"--muon_rms_rate=0.5 is a setting of --optimizer=muon; leave it out with --optimizer=adam"),
    (dict(muon_adam_lr_ratio=0.0), r"--muon_adam_lr_ratio=0.0 is out of range: must be > 0.0")],
    ids=["shard_update", "demo", "another_optimizer", "range"])
def test_refused_in_one_line_before_any_device(overrides, pattern, logdir, monkeypatch):
    made = []
    monkeypatch.setattr(devices, "setup", lambda *a, **k: made.append(1))
    with pytest.raises(ConfigError, match=pattern) as error:
        muon_config(logdir, **overrides).validated(on_disk=False)
    assert "\n" not in str(error.value) and made == []


class Subclassed(keras.Model):  # no graph of its outputs: no output layer mgloop can tell
    def __init__(self):
        super().__init__(name="subclassed")
        self.out = keras.layers.Dense(10)

    def call(self, x):
        return self.out(keras.ops.reshape(x, (keras.ops.shape(x)[0], -1)))


@pytest.mark.parametrize("case", ["untraced_output", "users_muon_sharded"])
def test_refused_in_one_line_before_any_copy(case, logdir, monkeypatch):
    from mgloop.step import replicas as replicas_lib
    built = []
    monkeypatch.setattr(replicas_lib.Replicas, "__init__", lambda *a, **k: built.append(1))
    with pytest.raises(ConfigError) as error:
        if case == "untraced_output":
            trainer_of(muon_config(logdir), Subclassed)
        else:
            trainer_of(muon_config(logdir, optimizer="sgd", devices="cpu:2", aggregation="ring",
                                   shard_update=True), optimizer=keras.optimizers.Muon(LR))
    want = ("the output layer of model 'subclassed' is not a layer" if case == "untraced_output"
            else "--shard_update needs an element-wise optimizer, and Muon is not")
    assert want in str(error.value) and "\n" not in str(error.value) and built == []


def mean_loss(model, steps, loss_fn=experiment.default_loss()):
    return np.mean([np.mean(loss_fn(tf.constant(y), model(tf.constant(x)))) for x, y in steps])


def test_muloco_trains_at_four_nodes(logdir):
    """DiLoCo (period 2, outer Nesterov 0.7 / 0.9) between 4 nodes, Muon inside: 8 steps
    (4 outer steps) lower the mean loss of the batches it trained on."""
    config = muon_config(logdir, devices="cpu:4", nodes=4, aggregation="diloco:period=2",
                         train_steps=8, steps_per_loop=8)
    trainer, steps = helpers.build_trainer(config), helpers.batches(8)
    before = mean_loss(trainer.model, steps)  # the template: copy 0's variables
    helpers.run_batches(trainer, steps)
    assert same_bits(*helpers.copy_weights(trainer))  # step 8 closes a period: both hold x
    after = mean_loss(trainer.model, steps)
    assert after < before, (before, after)


def one_step(logdir, aggregation):
    config = muon_config(logdir, devices="cpu:2", nodes=2, aggregation=aggregation,
                         train_steps=1, steps_per_loop=1)
    trainer = helpers.build_trainer(config)
    start = helpers.copy_weights(trainer)[0]
    helpers.run_batches(trainer, helpers.batches(1))
    return start, helpers.copy_weights(trainer)


def test_diloco_identity_with_muon_is_the_mean_of_the_nodes_muon_steps(tmp_path):
    """One step of diloco:period=1,outer_lr=1,outer_momentum=0: the nodes' inner Muon steps
    and their ring mean a are localsgd:period=1's, op for op; then delta = fl(x - a) and
    x' = fl(x - delta), so |x' - a| <= u |x - a| (1 + u) + u |a| <= 2u (|x - a| + |a|).
    The synchronous ring (Muon of the mean gradient) lies far outside that."""
    start, diloco = one_step(str(tmp_path / "d"), "diloco:period=1,outer_lr=1,outer_momentum=0")
    local_start, local = one_step(str(tmp_path / "local"), "localsgd:period=1")
    ring_start, ring = one_step(str(tmp_path / "ring"), "ring")
    assert same_bits(start, local_start, ring_start)  # the same start (the run's seed)
    bounds = [2 * tolerance.U * (np.abs(x.astype(np.float64) - a) + np.abs(a))
              for x, a in zip(start, local[0])]
    for copy in diloco:
        tolerance.assert_within(copy, local[0], bounds)
    apart = max(float((np.abs(r - a) / np.maximum(b, 1e-30)).max())
                for r, a, b in zip(ring[0], local[0], bounds))
    assert apart > 1e3  # Muon is not linear: the mean of the steps is not the step of the mean

