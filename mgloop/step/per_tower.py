"""Variable layouts and the per-tower pass.

There is one template Keras model. Its variables are variable copy 0; a
replicated layout adds one plain `tf.Variable` copy per further tower, created
on that tower's device from the template's initial values. Every tower runs the
template's computation on the values of the copy it reads, through
`model.stateless_call`, so the layouts differ only in which copy a tower reads:

    shared      one copy on the parameter device; every tower reads copy 0
    replicated  one copy per tower; tower t reads copy t

A tower computes, on its own device and with its own `tf.GradientTape`,

    loss_t = mean over its shard of loss_fn(y, model(x))  (+ the model's own losses)
    g[t][v] = d loss_t / d v

and returns them with its metrics' states and its updated non-trainable state
(e.g. batch-norm moving statistics) for the step (training_step.py) to combine.

`tower_pass` traces that pass once per tower; `SharedPass`, the step's choice whenever no
hook acts inside a tower's pass by its index, traces it once and calls it on every
tower's device (the same ops run, so the same bits).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

import keras
import tensorflow as tf

from mgloop.data import padding
from mgloop.training import metrics
from mgloop.step import precision
from mgloop.step.hooks import tape_gradients

LossFn = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


@dataclasses.dataclass
class TowerOutput:
    loss: tf.Tensor  # scalar: mean loss over the tower's shard
    metric_state: tf.Tensor  # float32 [M]: the metrics' states on the shard (metrics.py)
    grads: list[tf.Tensor | None]  # per trainable variable, on the tower's device; None if factored
    non_trainable: list[tf.Tensor]  # updated non-trainable state
    # variable index -> (x_t, dz_t), its gradient's factors (sufficient_factors.py)
    factors: dict[int, tuple[tf.Tensor, tf.Tensor]] = dataclasses.field(default_factory=dict)


def mean_loss(loss_fn: LossFn, y: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
    """Mean of `loss_fn` over the examples (works for per-example or already-mean losses);
    labels `padding.Weighted` (a padded short batch): the mean of w_i * l_i (padding.py)."""
    if isinstance(y, padding.Weighted):
        return padding.weighted_mean(loss_fn(y.labels, predictions), y.weights)
    return tf.reduce_mean(loss_fn(y, predictions))


def metric_state(metric_list, y, outputs) -> tf.Tensor:
    """The metrics' states (metrics.state) of the shard's real examples (padding.py)."""
    return metrics.state(metric_list, *padding.real_examples(y, outputs))


def call_kwargs(model: keras.Model, training: bool) -> dict:
    """`training=` for models whose `call` takes it (`stateless_call` does not filter it)."""
    parameters = inspect.signature(model.call).parameters.values()
    takes = any(p.name == "training" or p.kind == p.VAR_KEYWORD for p in parameters)
    return {"training": training} if takes else {}


def read(variables: list[tf.Variable]) -> list[tf.Tensor]:
    """The variables' current values, read on their own devices."""
    values = []
    for variable in variables:
        with tf.device(variable.device):
            values.append(variable.read_value())
    return values


def total_loss(loss_fn: LossFn, y, outputs, model_losses) -> tf.Tensor:
    """The mean of `loss_fn` over the shard plus the model's own losses (regularisers)."""
    loss = mean_loss(loss_fn, y, outputs)
    if not model_losses:  # a property of the model, not an option of the step
        return loss
    return loss + tf.add_n([tf.cast(extra, loss.dtype) for extra in model_losses])


def tower_pass(step, t: int, trainable: list[tf.Tensor], non_trainable: list[tf.Tensor],
               x, y) -> TowerOutput:
    """Forward, loss and gradients of tower t on its shard (x, y), all on its device.

    `trainable` and `non_trainable` are the values of the variable copy the tower
    reads, already on (or sent to) its device; x and y may be nested (every leaf is
    copied onto the tower). The outputs reach the loss as float32 (a mixed-precision
    model computes them in float16/bfloat16). Its loss reads the hooks' `labels` of y (y
    itself but for a label-flipping attacker); its metrics the true y. The tower
    differentiates what the hooks make of its loss (`scale_loss`: S * loss_t) once the
    hooks' `before_backward` tensors exist, by the hooks' backward (the tape's, or with
    factored products: sufficient_factors.py), and hands on the hooks' `unscale` of the
    gradients: g[t] = d(S loss_t)/dv / S. Its random layers draw from its own stream
    (random_streams.py).
    """
    template, hooks, streams = step.replicas.model, step.hooks, step.random_streams
    device = step.replicas.tower_devices[t]
    with tf.device(device):
        x, y = tf.nest.map_structure(tf.identity, (x, y))  # the shard's copy onto the tower
        state = streams.for_tower(non_trainable, t, device)
        with tf.GradientTape() as tape, hooks.tower_scope(t):
            tape.watch(trainable)
            outputs, new_state, model_losses = template.stateless_call(
                trainable, state, x, return_losses=True, **call_kwargs(template, True))
            outputs = tf.nest.map_structure(precision.to_float32, outputs)
            loss = total_loss(step.loss_fn, hooks.labels(t, y, outputs), outputs, model_losses)
            scaled = hooks.scale_loss(t, loss)
        with tf.control_dependencies(hooks.before_backward(t)):
            grads, factors = hooks.gradients(t, tape, scaled, trainable)
        return TowerOutput(loss, metric_state(step.metrics, y, outputs),
                           hooks.unscale(t, grads), streams.after_tower(non_trainable, new_state),
                           factors)


def forward_backward(step, trainable, state, x, y, kwargs: dict):
    """One shard's forward, loss and gradients with no hook acting by the tower's index:
    (loss, outputs as float32, grads as the step's backward gives them (an Embedding's as
    rows), the new non-trainable state)."""
    with tf.GradientTape() as tape:
        tape.watch(trainable)
        outputs, new_state, model_losses = step.replicas.model.stateless_call(
            trainable, state, x, return_losses=True, **kwargs)
        outputs = tf.nest.map_structure(precision.to_float32, outputs)
        loss = total_loss(step.loss_fn, y, outputs, model_losses)
    grads, _ = step.hooks.gradients(None, tape, loss, trainable)
    return loss, outputs, grads, list(new_state)


def pure_pass(step, trainable, state, x, y, kwargs: dict):
    """`forward_backward` with every gradient a dense tensor (an Embedding's rows
    included): the body vectorized_towers.py maps over a device's towers and
    compiled_towers.py compiles."""
    loss, outputs, grads, new_state = forward_backward(step, trainable, state, x, y, kwargs)
    return loss, outputs, [tf.convert_to_tensor(g) for g in grads], new_state


def group_pass(step, group: range, trainable, states, xs, ys) -> list[TowerOutput]:
    """The towers of `group` one traced pass each (`tower_pass`); with one tower per device
    a group is one tower (vectorized_towers.device_pass computes a device's K at once)."""
    return [tower_pass(step, t, trainable, state, x, y)
            for t, state, x, y in zip(group, states, xs, ys)]


class SharedPass:
    """The tower loop's group pass (one tower per device) with the pass traced ONCE: when no
    hook acts inside a tower's pass by its index (hooks.IN_TOWER_PASS) and the backward is
    the tape's, tower t's pass is the same function of its own inputs on every tower,

        (v, s_t, x_t, y_t) -> (loss_t, metric state_t, g[t] = d loss_t / d v, s'_t),

    so it is one `tf.function` (not compiled) called on each tower's device, where
    `tower_pass` traced T copies of it. What reads the tower's index stays outside, as in
    `tower_pass`: the shard's copy onto the device, the random streams' keys
    (random_streams.py) and the hooks' `unscale`. When the step's function is instantiated
    TensorFlow inlines each call, its ops placed on the caller's device, so the graph that
    runs holds the same ops per tower as T traces: the same bits (every equality of the
    tower loop with one device, simulated nodes and workers holds through it), at about
    1/T of the pass's tracing (the pass is most of a small model's step to trace).
    """

    def __init__(self):
        self._body = None
        self._per_tower = False  # the traced body read a variable of its own: one per tower

    @staticmethod
    def serves(hooks) -> bool:
        """Whether the step's `hooks` leave every tower's pass alike (class docstring)."""
        return hooks.gradients is tape_gradients and not any(
            hook.acts_in_tower_pass() for hook in hooks.hooks)

    def _traced(self, step):
        if self._body is None:
            kwargs = call_kwargs(step.replicas.model, True)

            def body(trainable, state, x, y):
                loss, outputs, grads, new_state = forward_backward(step, trainable, state, x,
                                                                   y, kwargs)
                return loss, metric_state(step.metrics, y, outputs), grads, new_state

            self._body = tf.function(body, autograph=False)  # as the step (loop.py)
        return self._body

    def __call__(self, step, group: range, trainable, states, xs, ys) -> list[TowerOutput]:
        """Tower t = group[0] on its shard: the traced body on its device, then the hooks'
        `unscale` and the random streams' state as `tower_pass` gives them. A body that
        reads or writes a variable of its own (a user's loss or metric keeping state) would
        have every tower's call act on that one variable, so such a step traces its towers'
        passes one by one (`group_pass`), as before."""
        if self._per_tower:
            return group_pass(step, group, trainable, states, xs, ys)
        (t,) = group
        streams, device = step.random_streams, step.replicas.tower_devices[t]
        with tf.device(device):
            x, y = tf.nest.map_structure(tf.identity, (xs[0], ys[0]))  # the shard onto it
            state = streams.for_tower(states[0], t, device)
        args = (list(trainable), state, x, y)
        with tf.compat.v1.get_default_graph().device(None):  # its ops traced with no device
            body = self._traced(step).get_concrete_function(*args)  # (a tower's device in
            # the trace's key would trace it again for every tower)
        if any(value.dtype == tf.resource for value in body.captured_inputs):
            self._per_tower = True
            return group_pass(step, group, trainable, states, xs, ys)
        with tf.device(device):  # the call's device: each inlined op's (class docstring)
            loss, metric, grads, new_state = body(*args)
            return [TowerOutput(loss, metric, step.hooks.unscale(t, grads),
                                streams.after_tower(states[0], new_state))]


def tower_loop_pass(hooks):
    """The group pass of the tower loop (one tower per device) for the step's `hooks`: the
    pass traced once (`SharedPass`) where they leave every tower's pass alike, else one
    trace per tower (`group_pass`)."""
    return SharedPass() if SharedPass.serves(hooks) else group_pass
