"""The compute per step a run's link model uses (observe/hardware.py), and the FLOPs of one
example's training step it needs, counted from the traced step of the template model.

`flops_per_example` traces, as a tf.function of one tower's shard (b = the per-tower
batch, a batch of b examples of the input's feature and label specs), what a tower
computes (step/per_tower.py `tower_pass`, without the hooks): the template model's
forward pass (`stateless_call`, training=True), the loss (`per_tower.total_loss`: the run's
loss and the model's own losses) and the gradients of the trainable variables by a
`tf.GradientTape`; it counts the traced graph's matrix products and convolutions
(observe/flops.py) and divides by b. The function is traced, never run: no variable,
random stream or optimizer state is read or changed, so a run trains the same with or
without `--compute`. The update (the optimizer's element-wise ops) is not in the count.
"""

from __future__ import annotations

from absl import logging
import tensorflow as tf

from mgloop.aggregation.local import async_run
from mgloop.observe import flops as flops_lib
from mgloop.observe import hardware
from mgloop.observe import link_model
from mgloop.step import precision
from mgloop.step import per_tower


def _batched(spec, size: int) -> tf.TensorSpec:
    return tf.TensorSpec([size, *spec.shape], spec.dtype)


def traced_step(model, loss_fn, features_spec, labels_spec, batch: int):
    """The concrete function of one shard's forward, loss and gradients (module top)."""
    trainable, state = model.trainable_variables, model.non_trainable_variables
    kwargs = per_tower.call_kwargs(model, True)

    @tf.function(autograph=False)
    def step(x, y):
        values = [v.value for v in trainable]
        with tf.GradientTape() as tape:
            tape.watch(values)
            outputs, _, model_losses = model.stateless_call(
                values, [v.value for v in state], x, return_losses=True, **kwargs)
            outputs = tf.nest.map_structure(precision.to_float32, outputs)
            loss = per_tower.total_loss(loss_fn, y, outputs, model_losses)
        return tape.gradient(loss, values)

    specs = tf.nest.map_structure(lambda s: _batched(s, batch), (features_spec, labels_spec))
    return step.get_concrete_function(*specs)


def flops_per_example(model, loss_fn, features_spec, labels_spec,
                      batch: int) -> flops_lib.Count:
    """The FLOPs of the traced step of `batch` examples (module top), per example."""
    count = flops_lib.count(traced_step(model, loss_fn, features_spec, labels_spec,
                                        batch).graph)
    count.flops /= batch
    return count


def of_run(config, trainer, median_step_time: float | None, exchange_alone: float | None,
           example_spec) -> hardware.Compute:
    """The run's compute per step (hardware.modelled) for its --compute and --node_speeds;
    `example_spec` the input's (features, labels) specs of one example. A profile whose
    FLOPs cannot be counted (a trace that fails, shapes not static) gives C None, with one
    warning; ops left uncounted (control flow, calls) are named in another."""
    setting = hardware.parse(config.compute)
    speeds = hardware.parse_speeds(config.node_speeds, _nodes(config, trainer))
    measured = link_model.compute_seconds(median_step_time, exchange_alone)
    fastest = async_run.staleness_of(trainer.aggregation) is not None  # no node waits
    if setting.kind != hardware.PROFILE:
        return hardware.modelled(setting, measured, speeds=speeds, fastest=fastest)
    per_tower = config.batch_size_per_tower * config.accumulation_steps
    try:
        count = flops_per_example(trainer.model, trainer.loss_fn, *example_spec,
                                  config.batch_size_per_tower)
    except Exception as error:  # noqa: BLE001 -- a model the trace cannot take: C unknown
        logging.warning("--compute=%s: the training step could not be traced to count its "
                        "FLOPs (%s: %s); compute_seconds is null", config.compute,
                        type(error).__name__, error)
        return hardware.modelled(setting, measured, None, per_tower, speeds, fastest)
    if count.uncounted:
        logging.warning("--compute=%s: FLOPs of %d ops not counted (%s): the modelled compute "
                        "leaves them out", config.compute, len(count.uncounted),
                        ", ".join(sorted(set(count.uncounted))))
    return hardware.modelled(setting, measured, count.flops, per_tower, speeds, fastest)


def _nodes(config, trainer) -> int:
    """The nodes the --node_speeds are of: the workers (each a node), else --nodes."""
    cluster = trainer.aggregation.cluster
    return cluster.num_workers if cluster is not None and cluster.num_workers > 1 else config.nodes
