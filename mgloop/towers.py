"""Variable layouts and the per-tower step.

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

and returns them with its updated non-trainable state (e.g. batch-norm moving
statistics) for the aggregation to average.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import TYPE_CHECKING, Callable, Sequence

import keras
import tensorflow as tf

from mgloop import accuracy
from mgloop import precision

if TYPE_CHECKING:
    from mgloop.sufficient_factors import SufficientFactors

LossFn = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]


@dataclasses.dataclass
class VariableCopy:
    """One copy of the model's variables on one device, with its own optimizer state."""

    device: str
    trainable: list[tf.Variable]
    non_trainable: list[tf.Variable]
    optimizer: keras.optimizers.Optimizer | None = None

    @property
    def variables(self) -> list[tf.Variable]:
        return self.trainable + self.non_trainable


@dataclasses.dataclass
class TowerOutput:
    loss: tf.Tensor  # scalar: mean loss over the tower's shard
    accuracy_counts: tf.Tensor  # float32 [correct, compared] on the shard (accuracy.py)
    grads: list[tf.Tensor | None]  # per trainable variable, on the tower's device; None if factored
    non_trainable: list[tf.Tensor]  # updated non-trainable state
    # variable index -> (x_t, dz_t), its gradient's factors (sufficient_factors.py)
    factors: dict[int, tuple[tf.Tensor, tf.Tensor]] = dataclasses.field(default_factory=dict)


def backing(variable) -> tf.Variable:
    """The tf.Variable behind a Keras variable (the object TensorFlow places)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def make_copies(template: keras.Model, devices: list[str]) -> list[VariableCopy]:
    """Copy 0 is the template's own variables (built on devices[0]); then one per device."""
    first = VariableCopy(devices[0],
                         [backing(v) for v in template.trainable_variables],
                         [backing(v) for v in template.non_trainable_variables])
    copies = [first]
    for index, device in enumerate(devices[1:], start=1):
        with tf.device(device):
            def clone(source, trainable):
                name = f"replica_{index}/{source.name.split(':')[0]}"
                return tf.Variable(source.read_value(), trainable=trainable, name=name)
            copies.append(VariableCopy(device,
                                       [clone(v, True) for v in first.trainable],
                                       [clone(v, False) for v in first.non_trainable]))
    return copies


def copy_first_to_rest(copies: list[VariableCopy]) -> None:
    """Makes every copy (variables and optimizer state) equal to copy 0, e.g. after a restore."""
    first = copies[0]
    first_slots = first.optimizer.variables if first.optimizer else []
    for copy in copies[1:]:
        slots = copy.optimizer.variables if copy.optimizer else []
        for target, source in zip(copy.variables + slots, first.variables + first_slots):
            target.assign(backing(source).read_value())


def mean_loss(loss_fn: LossFn, y: tf.Tensor, predictions: tf.Tensor) -> tf.Tensor:
    """Mean of `loss_fn` over the examples (works for per-example or already-mean losses)."""
    return tf.reduce_mean(loss_fn(y, predictions))


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


def tower_step(template: keras.Model, loss_fn: LossFn, trainable: list[tf.Tensor],
               non_trainable: list[tf.Tensor], x: tf.Tensor, y: tf.Tensor,
               device: str, loss_scale: tf.Tensor | None = None,
               backward_after: Sequence[tf.Tensor] = (),
               factor: SufficientFactors | None = None
               ) -> TowerOutput:
    """Forward, loss and gradients of one tower on its shard, all on `device`.

    `trainable` and `non_trainable` are the values of the variable copy the
    tower reads, already on (or sent to) its device. The logits reach the loss
    as float32 (a mixed-precision model computes them in float16/bfloat16).
    With a `loss_scale` S (on `device`), the tape differentiates S * loss_t and
    the gradients are divided by S again: g[t] = d(S loss_t)/dv / S.
    The backward pass starts only after the tensors `backward_after` exist
    (ordered_sum.py: the previous towers' large gradients have been added).
    For the variables `factor` finds used by one matrix product z_t = x_t W, the
    tower returns the factors (x_t, dz_t / S) instead of g[t][W] = x_t^T dz_t / S
    (sufficient_factors.py; their `grads` entries are None).
    """
    with tf.device(device):
        x, y = tf.identity(x), tf.identity(y)  # the shard's copy onto the tower
        forward = factor.tower() if factor else contextlib.nullcontext()
        with tf.GradientTape() as tape, forward:
            tape.watch(trainable)
            logits, new_non_trainable, model_losses = template.stateless_call(
                trainable, non_trainable, x, return_losses=True, **call_kwargs(template, True))
            logits = precision.to_float32(logits)
            loss = mean_loss(loss_fn, y, logits)
            if model_losses:
                loss += tf.add_n([tf.cast(l, loss.dtype) for l in model_losses])
            scaled = loss if loss_scale is None else loss * loss_scale
        products = forward.products(trainable) if factor else {}
        with tf.control_dependencies(backward_after):
            if products:
                grads, factors = forward.gradients(scaled, trainable, products)
            else:
                grads, factors = tape.gradient(
                    scaled, trainable, unconnected_gradients=tf.UnconnectedGradients.ZERO), {}
        if loss_scale is not None:
            grads = [None if g is None else g / loss_scale for g in grads]
            factors = {i: (x, dz / loss_scale) for i, (x, dz) in factors.items()}
        return TowerOutput(loss, accuracy.counts(loss_fn, y, logits), grads,
                           list(new_non_trainable), factors)
