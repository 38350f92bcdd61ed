"""Weight-decay exclusions (`exclude_from_weight_decay`) hold on every variable copy.

Copy 0's optimizer decides which variables decay, by Keras's rule on the template's
variables; every other copy's optimizer decays exactly the corresponding variables, whatever
their names ("replica_1/...") and identities. So with an exact all-reduce (the ring on two
copies: (a + b) / 2, one order of sum) every copy holds copy 0's bits, and the run equals a
one-device Keras loop with the same exclusion within tests/tolerance.py's bound. AdamW with
weight_decay=0.5 moves an excluded bias by lr wd |b| a step more if decayed: at lr 0.05 and
|b| ~ 0.1, ~2e-3 a step, far outside the bound (~1e-6). Adam's epsilon is 1e-3, inside the
bound's premise (tests/tolerance.py 3.: at Keras's 1e-7, 5 of 40 random initial weights fell
outside it, excluded or not); the user's template is made after seeding, as a run's is.

- a factory excluding by an anchored name pattern (copy 0's biases are named by their paths,
  "mlp/dense_3/bias:0", copy 1's "replica_1/mlp/dense_3/bias:0"), and by identity (var_list
  of the template's biases);
- an optimizer object, given to the run or compiled into the model, excluding by name or by
  the template's variables: Keras's config leaves the exclusions out, and they are carried;
- a pattern that decides otherwise on Keras 3's short names ("bias", which Keras's fit
  matches) than on the paths mgloop matches is logged as a warning;
- what cannot be carried is refused in one line: a var_list of variables that are not the
  template's (before any copy), and a `_use_weight_decay` of the class's own that decides a
  copy's variable unlike the template's.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from mgloop.cluster import devices
from mgloop.errors import ConfigError
from mgloop.runs import experiment
from tests import helpers
from tests import tolerance

STEPS = 4
LR, DECAY, EPSILON = 0.05, 0.5, 1e-3


def adamw():
    return keras.optimizers.AdamW(LR, weight_decay=DECAY, epsilon=EPSILON)


def template_mlp():
    """The user's model, made before the run, from the seed the run starts from."""
    experiment.seed_everything(3, True)
    return helpers.model_fn("mlp")()


def trainer_of(make_model, optimizer, devices_spec="cpu:2"):
    config = helpers.small_config("/unused", devices=devices_spec, aggregation="ring",
                                  train_steps=STEPS, steps_per_loop=STEPS).validated()
    device_set = devices.setup(devices.parse(config.devices))
    return experiment.build_trainer(config, device_set, make_model, experiment.default_loss(),
                                    helpers.DATASET.input_shape, optimizer=optimizer)


def keras_reference(initial, exclude, steps):
    """The one-device Keras loop from `initial` weights: AdamW excluding, by `exclude(model)`
    (model -> its variables to exclude), what the run excludes; (weights, StepBound)."""
    with tf.device("/device:CPU:0"):
        model = helpers.model_fn("mlp")()
        model.set_weights(initial)
        optimizer = adamw()
        optimizer.exclude_from_weight_decay(var_list=exclude(model))
        loss_fn = experiment.default_loss()
        bound = tolerance.StepBound()
        for x, y in steps:
            x, y = tf.constant(x), tf.constant(y)
            bound.before(model, optimizer, loss_fn, x, y)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(loss_fn(y, model(x, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            bound.after()
    return [v.numpy() for v in model.trainable_variables], bound


def assert_copies_equal_one_device(trainer, exclude):
    """Trains `trainer` STEPS steps: every copy the bits of copy 0, and within the bound of
    the one-device Keras loop from the same initial weights excluding `exclude(model)`."""
    initial = helpers.copy_weights(trainer)[0]
    steps = helpers.batches(STEPS)
    helpers.run_batches(trainer, steps)
    weights = helpers.copy_weights(trainer)
    names = [v.name for v in trainer.copies[0].trainable]
    for c, copy in enumerate(weights[1:], start=1):
        for name, first, other in zip(names, weights[0], copy):
            assert np.array_equal(first, other), f"copy {c}'s {name} differs from copy 0's"
    expected, bound = keras_reference(initial, exclude, steps)
    tolerance.assert_within(weights[0], expected, bound.weights())


def biases(model):
    return [v for v in model.trainable_variables if v.name == "bias"]


def first_bias(model):
    return [model.trainable_variables[1]]  # the first Dense layer's bias


def test_a_factory_excluding_by_an_anchored_pattern_holds_on_every_copy(caplog):
    def anchored():
        optimizer = adamw()
        optimizer.exclude_from_weight_decay(var_names=[r"^mlp/dense(_\d+)?/bias"])
        return optimizer
    trainer = trainer_of(helpers.model_fn("mlp"), anchored)
    assert trainer.copies[1].trainable[1].name.startswith("replica_1/mlp/")  # not matched
    assert_copies_equal_one_device(trainer, biases)
    # Keras's fit would match the short name "bias", which the anchor does not: said once
    assert "decides 2 of them" in caplog.text and "Keras's short names" in caplog.text


def test_a_factory_excluding_the_templates_variables_by_identity_holds_on_every_copy():
    template = template_mlp()

    def excluding_its_biases():
        optimizer = adamw()
        optimizer.exclude_from_weight_decay(var_list=biases(template))
        return optimizer
    trainer = trainer_of(lambda: template, excluding_its_biases)
    assert_copies_equal_one_device(trainer, biases)


@pytest.mark.parametrize("given", ["run", "compiled"])
def test_an_optimizer_objects_exclusion_by_name_is_carried_to_every_copy(given):
    optimizer = adamw()
    optimizer.exclude_from_weight_decay(var_names=["bias"])

    def compiled():
        model = helpers.model_fn("mlp")()
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
        return model
    trainer = (trainer_of(helpers.model_fn("mlp"), optimizer) if given == "run"
               else trainer_of(compiled, None))
    assert trainer.spec.sources["optimizer"] == ("run" if given == "run" else "compiled model")
    assert_copies_equal_one_device(trainer, biases)


def test_an_optimizer_objects_exclusion_of_the_templates_variables_is_carried():
    template = template_mlp()
    optimizer = adamw()
    optimizer.exclude_from_weight_decay(var_list=first_bias(template))
    template.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    trainer = trainer_of(lambda: template, None)
    assert_copies_equal_one_device(trainer, first_bias)


def foreign_exclusion():
    optimizer = adamw()
    optimizer.exclude_from_weight_decay(var_list=biases(helpers.model_fn("mlp")()))
    return optimizer


@pytest.mark.parametrize("optimizer", [foreign_exclusion(), foreign_exclusion],
                         ids=["object", "factory"])
def test_excluding_variables_that_are_not_the_templates_is_refused_before_any_copy(
        optimizer, monkeypatch):
    from mgloop.step import replicas as replicas_lib
    built = []
    monkeypatch.setattr(replicas_lib.Replicas, "__init__", lambda *a, **k: built.append(1))
    with pytest.raises(ConfigError, match=r"exclude_from_weight_decay\(var_list=...\) names "
                       r"2 variable\(s\) that are not the template model's.*var_names=") as error:
        trainer_of(helpers.model_fn("mlp"), optimizer)
    assert "\n" not in str(error.value) and built == []


class DecaysByName(keras.optimizers.AdamW):
    """A weight-decay rule of its own, on names: a variable named "mlp/..." never decays."""

    def _use_weight_decay(self, variable):
        return not variable.name.startswith("mlp/")


def test_a_rule_of_its_own_that_decides_a_copy_unlike_the_template_is_refused():
    with pytest.raises(ConfigError, match="DecaysByName's _use_weight_decay decides weight "
                       "decay by its own rule") as error:
        trainer_of(helpers.model_fn("mlp"), lambda: DecaysByName(LR, weight_decay=DECAY))
    assert "\n" not in str(error.value)
    trainer_of(helpers.model_fn("mlp"), lambda: DecaysByName(LR, weight_decay=DECAY),
               devices_spec="cpu:1")  # one copy: its own rule, as Keras applies it
