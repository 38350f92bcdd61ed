"""A run prepared to study one part of it, without `mgloop.run`'s loop: for tests and
experiments/.

    method_settings(spec)   "METHOD --key=value ..." -> (METHOD, {key: value})
    method_config(spec, logdir, **settings)   a small deterministic run of one method
    trainer_for(config, dataset, ...)   the trainer `mgloop.run` would build for a config,
                            on this process's devices, for a dataset's shapes
    train_on(trainer, batches)   given (x, y) batches through its compiled loop

The trainer is built as `mgloop.run` builds it (`experiment.build_trainer`): the same
validation, devices, seeding, model copies and step; no data is read, and nothing is
written but what `Config.validated()` makes (the logdir).
"""

from __future__ import annotations

import contextlib
import os

from mgloop.runs.config import Config

# The small deterministic run of `method_config`: the MLP, momentum SGD, 4 steps in one
# loop, nothing written between loops; what the comparisons of a method between real
# workers and simulated nodes train (tests/workers/, experiments/methods_between_nodes.py);
# its exchange is not timed apart after training (the comparisons read bytes, not seconds).
SMALL_RUN = dict(model="mlp", global_batch_size=64, optimizer="momentum", learning_rate=0.1,
                 train_steps=4, steps_per_loop=4, seed=3, deterministic=True, summary_every=0,
                 log_every=0, diagnostics=False, collective_timeout=60, time_exchange=False)


def method_settings(spec: str) -> tuple[str, dict]:
    """`METHOD --key=value ...` -> (METHOD, {key: value}), numbers read as numbers, true and
    false as booleans."""
    method, *rest = spec.split()
    settings = {}
    for item in rest:
        key, _, value = item[2:].partition("=")
        value = {"true": True, "false": False}.get(value, value)
        for kind in (int, float):
            with contextlib.suppress(ValueError):
                value = kind(value)
                break
        settings[key] = value
    return method, settings


def method_config(spec: str, logdir: str, **settings) -> Config:
    """`SMALL_RUN` of the method `spec` (`METHOD [--key=value ...]`: settings after the
    method) in `logdir`, exported to `logdir`/export; then `settings` over them. A method
    that applies momentum itself gets plain SGD outside it, one that `needs_optimizer` that."""
    from mgloop import aggregation
    method, own = method_settings(spec)
    values = dict(SMALL_RUN, aggregation=method, logdir=logdir,
                  export_dir=os.path.join(logdir, "export"), **own)
    values.update(settings)
    kind, options = aggregation.parse(method)
    if kind.applies_momentum(options):
        values["optimizer"] = "sgd"
    if kind.capabilities.needs_optimizer:  # des_loc: adam
        values["optimizer"] = kind.capabilities.needs_optimizer
    return Config(**values)


def trainer_for(config: Config, dataset, model_fn=None, loss_fn=None, input_shape=None):
    """The Trainer of `config` (validated; its devices set up in this process) for
    `dataset`'s shapes: `model_fn` (default: the config's --model for the dataset's input
    shape and classes), `loss_fn` (default: mgloop's), `input_shape` of the data it will be
    fed (default: the dataset's)."""
    from mgloop import models
    from mgloop.cluster import devices
    from mgloop.runs import experiment
    config = config.validated()
    device_set = devices.setup(devices.parse(config.devices, config.towers_per_device))
    make_model = model_fn or models.builder_of(config.models, dataset.input_shape,
                                               dataset.num_classes)
    return experiment.build_trainer(config, device_set, make_model,
                                    loss_fn or experiment.default_loss(),
                                    input_shape or dataset.input_shape)


def train_on(trainer, batches) -> float:
    """Runs the (x, y) numpy batches, one per step, in one compiled loop; returns the sum
    of the step losses."""
    if not batches:
        return 0.0
    result = trainer.train_loop(_iterator_of(batches), len(batches))
    if result.steps != len(batches):
        raise RuntimeError(f"the loop ran {result.steps} of {len(batches)} steps")
    return result.loss_sum


def trace_on(trainer, batches) -> None:
    """Traces the compiled loop `train_on` would call on these batches, without running it
    (no graph optimization, no step): what the step hands its parts at trace time (e.g. the
    method's `reduce`, its traffic counts), at about 0.6 of `train_on`'s first call."""
    import tensorflow as tf
    iterator = _iterator_of(batches)
    trainer.staging.prime(iterator)
    trainer.loop.compiled_loop.get_concrete_function(iterator, tf.constant(len(batches)))


def _iterator_of(batches):
    """An iterator of the stacked (x, y) numpy batches, read without tf.data's autotuning
    (staging.synchronous): an iterator with it takes 1-5 s to delete once a compiled loop
    has read it (measured), paid again by every trainer dropped."""
    import numpy as np
    import tensorflow as tf
    from mgloop.data import staging
    xs = np.stack([x for x, _ in batches])
    ys = np.stack([y for _, y in batches])
    return iter(staging.synchronous(tf.data.Dataset.from_tensor_slices((xs, ys))))
