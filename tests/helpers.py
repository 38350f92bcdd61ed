"""Shared pieces of the tests: a small config, mgloop trainers, the single-device reference."""

from __future__ import annotations

import dataclasses
import functools
import hashlib

import keras
import numpy as np
import tensorflow as tf

from mgloop import data, models
from mgloop.runs import config as config_lib
from mgloop.runs import experiment
from mgloop.runs import prepare
from mgloop.training import optim
from mgloop.step import precision
from mgloop.runs.config import Config
from tests import tolerance
from third_party import single_device

DATASET = data.synthetic.make(seed=7, num_train=256, num_eval=64)
GLOBAL_BATCH = 16
SMALL_MLP_DEPTH = 1  # small_config's mlp: one hidden layer


def small_config(logdir: str, **overrides) -> Config:
    # diagnostics off: its statistics add ops to every trace (test_diagnostics sets it);
    # the exchange not timed apart after training (a second trace of it; the tests of
    # exchange_seconds and the measured compute set time_exchange=True)
    # the mlp with one hidden layer: 4 variables where the default's 2 make 6, and a traced
    # step's ops grow with the variables (a test that needs more sets mlp_depth)
    settings = dict(devices="cpu:1", aggregation="ps_cpu", model="mlp", diagnostics=False,
                    time_exchange=False,
                    global_batch_size=GLOBAL_BATCH, optimizer="momentum", learning_rate=0.1,
                    train_steps=5, steps_per_loop=5, seed=3, deterministic=True,
                    logdir=logdir, summary_every=0, log_every=0)
    settings.update(overrides)
    if settings["model"] == "mlp":
        settings.setdefault("mlp_depth", SMALL_MLP_DEPTH)
    return Config(**settings)


def model_fn(name: str):
    """`name`'s builder for DATASET (the mlp as small_config's)."""
    own = dict(mlp_depth=SMALL_MLP_DEPTH) if name == "mlp" else {}
    return functools.partial(models.get(name), DATASET.input_shape, DATASET.num_classes, **own)


def batches(steps: int, global_batch: int = GLOBAL_BATCH, seed: int = 3):
    """The first `steps` global batches of the training stream, as numpy pairs (read from
    tf.data once per arguments in a test process, ~60 ms each; every call gets copies)."""
    return [(x.copy(), y.copy()) for x, y in _stream(steps, global_batch, seed)]


@functools.lru_cache(maxsize=None)
def _stream(steps: int, global_batch: int, seed: int):
    stream = DATASET.train_batches(global_batch, seed).take(steps)
    return tuple((x.numpy(), y.numpy()) for x, y in stream)


def build_trainer(config: Config, make_model=None, loss_fn=None, input_shape=None):
    """mgloop's trainer for `config` (default: the config's model and cross-entropy).

    `input_shape`: one example's shape of the data the trainer will be fed (checked
    against the model's declared input); default DATASET's.
    """
    return prepare.trainer_for(config, DATASET, make_model, loss_fn, input_shape)


def fit(trainer, batches, train_steps: int, global_batch: int, steps_per_loop: int,
        summary_every: int = 0, log_every: int = 0, checkpoint_every: int = 0, **parts):
    """`Controller(LoopPlan, LoopParts).train()` of `trainer` on `batches` (the other
    LoopParts, e.g. summaries=, as keywords)."""
    from mgloop.runs import controller
    plan = controller.LoopPlan(train_steps, global_batch, steps_per_loop, summary_every,
                               log_every, checkpoint_every)
    return controller.Controller(plan, controller.LoopParts(trainer, batches, **parts)).train()


def run_batches(trainer, steps_batches) -> float:
    """Runs the given (x, y) batches in one compiled loop; returns the sum of step losses."""
    return prepare.train_on(trainer, steps_batches)


def trace_batches(trainer, steps_batches) -> None:
    """Traces the compiled loop `run_batches` would call, without running it
    (prepare.trace_on): for what a test checks at trace time."""
    prepare.trace_on(trainer, steps_batches)


def train_mgloop(config: Config, steps_batches):
    """Builds mgloop's trainer for `config` and runs the given batches in one loop."""
    trainer = build_trainer(config)
    return trainer, run_batches(trainer, steps_batches)


def train_reference(config: Config, steps_batches):
    """The single-device reference (third_party.single_device) on the same global batches."""
    model, loss_sum = train_reference_model(config, steps_batches)
    return [v.numpy() for v in model.trainable_variables], loss_sum


def train_reference_bounded(config: Config, steps_batches, make_model=None):
    """The single-device reference's trainable weights, loss sum, and the bound
    (tolerance.StepBound) on how far any other summation order may lie from them.

    With the config's own model, run once per test process for each config (all but its
    logdir and the settings the reference neutralises) and batches: many tests of several
    modules check against the same run (the small config on `batches(5)`). Each call gets
    copies of the weights; the bound is shared (it is only read once made)."""
    key = None if make_model is not None else _reference_key(config, steps_batches)
    if key is None or key not in _REFERENCES:
        bound = tolerance.StepBound()
        model, loss_sum = train_reference_model(config, steps_batches, make_model, bound)
        run = [v.numpy() for v in model.trainable_variables], loss_sum, bound
        if key is None:
            return run
        _REFERENCES[key] = run
    weights, loss_sum, bound = _REFERENCES[key]
    return [w.copy() for w in weights], loss_sum, bound


_REFERENCES = {}  # train_reference_bounded's runs of the config's own model, by _reference_key


def _reference_key(config: Config, steps_batches):
    """What the reference run of `config`'s own model on `steps_batches` depends on: every
    setting but the logdir and those train_reference_model neutralises, and the batches'
    bytes."""
    defaults = {field.name: field.default for field in config_lib.setting_fields()}
    neutral = {name: defaults[name] for name in _NEUTRAL}
    settings = repr(dataclasses.replace(config, devices="cpu:1", logdir="", **neutral))
    digest = hashlib.sha256()
    for x, y in steps_batches:
        for array in (np.asarray(x), np.asarray(y)):
            digest.update(f"{array.dtype}{array.shape}".encode())
            digest.update(np.ascontiguousarray(array).tobytes())
    return settings, len(steps_batches), digest.hexdigest()


def bound_of_run(config: Config, steps: int):
    """tolerance.StepBound of the one-device run of `config`'s first `steps` steps on its own
    dataset's stream (as mgloop.run reads it): any other summation order of them, e.g. a
    run with another tower count or worker count, lies within bound.weights() of it."""
    settings = config.validated()
    dataset = data.load(settings.dataset, settings.seed, settings.data_dir,
                        settings.sequence_length)
    stream = data.epochs.step_batches(dataset, settings.global_batch_size,
                                      settings.accumulation_steps, settings.seed, 0,
                                      settings.drop_remainder).take(steps)
    return train_reference_bounded(config, [(x.numpy(), y.numpy()) for x, y in stream])[2]


_NEUTRAL = ("aggregation", "pack_bytes", "transport_dtype", "ordered_sum_bytes",
            "sufficient_factor_bytes", "nodes", "method_at", "within_node")


def train_reference_model(config: Config, steps_batches, make_model=None, bound=None):
    """The single-device reference as a trained Keras model (every weight), and its loss sum.

    Built under `config.mixed_precision`'s policy; with mixed_float16 the
    optimizer is Keras's LossScaleOptimizer (the Keras mixed-precision guide loop).
    `bound` (tolerance.StepBound, float32 only) accumulates the bound on the difference
    of any other summation order along the way.
    """
    # One device: the aggregation's own settings are the defaults (they mean nothing here).
    defaults = {field.name: field.default for field in config_lib.setting_fields()}
    neutral = {name: defaults[name] for name in _NEUTRAL}
    config = dataclasses.replace(config, devices="cpu:1", **neutral).validated()
    experiment.seed_everything(config.seed, config.deterministic)
    with tf.device("/device:CPU:0"):
        with precision.policy_scope(config.mixed_precision):
            model = (make_model or models.builder_of(config.models, DATASET.input_shape,
                                                     DATASET.num_classes))()
        optimizer = optim.make_optimizer(config.optim, config.train_steps)
        if config.mixed_precision == "none":
            step = single_device.make_train_step(model, experiment.default_loss(), optimizer)
        else:
            if precision.uses_loss_scaling(config.mixed_precision):
                optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
            step = single_device.make_mixed_precision_train_step(
                model, experiment.default_loss(), optimizer)
        if model.built and model.trainable_variables:
            # its slots made now, as its first apply would: a step that makes variables on
            # its first call is traced twice (once making them, once without)
            optimizer.build(model.trainable_variables)
        loss_sum = 0.0
        for x, y in steps_batches:
            if bound is not None:
                bound.before(model, optimizer, experiment.default_loss(), tf.constant(x),
                             tf.constant(y))
            loss_sum += float(step(tf.constant(x), tf.constant(y)))
            if bound is not None:
                bound.after()
    return model, loss_sum


def copy_weights(trainer):
    """Trainable values of every variable copy: [copy][variable] numpy arrays."""
    return [[v.numpy() for v in copy.trainable] for copy in trainer.copies]
