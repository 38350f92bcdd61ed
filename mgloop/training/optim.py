"""Optimizers, learning-rate schedules, and applying the averaged gradients.

Every variable copy has its own Keras optimizer (and so its own slots) on the
copy's device. All copies receive the same averaged gradient and start from the
same state, so replicated copies stay bit-identical; a shared layout has one
copy, hence one optimizer, applied once.

Schedules (step = number of updates applied so far):
    constant  lr(step) = LR
    poly      lr(step) = LR * (1 - step / D) ** lr_power   (Caffe's "poly")
    cosine    lr(step) = LR * (1 + cos(pi * step / D)) / 2
with D = train_steps - warmup_steps. With warmup W > 0 the rate first rises
linearly, lr(step) = LR * (step + 1) / W for step < W, then follows the
schedule shifted by W. Weight decay is Keras's decoupled decay:
v <- v - lr * weight_decay * v at every update.

Which variables decay is copy 0's optimizer's decision, on copy 0's variables (the
template's, named by their paths: "mlp/dense/bias:0"), by Keras's own rule
(`exclude_from_weight_decay(var_list=..., var_names=...)`): every other copy's optimizer is
told the same decision by identity, for its own corresponding variables
(`build_optimizers`). Its variables are clones with other names ("replica_1/...") and
identities, which a var_list or an anchored name pattern does not reach; decided on its
own, copy 1 would decay what copy 0 does not, and the replicas would drift apart. Keras's
own `fit` matches var_names against Keras 3's short names ("bias"); a pattern that decides
a variable otherwise on its path is logged (a warning), as mgloop decides on the path.
--optimizer=muon is Keras's Muon (muon.py), whose AdamW part is decided and told alike.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from mgloop.errors import ConfigError
from mgloop.training import muon
from mgloop.training.options import OptimOptions
from mgloop.training.variables import VariableCopy, backing

schedules = keras.optimizers.schedules


@keras.saving.register_keras_serializable(package="mgloop")
class LinearWarmup(schedules.LearningRateSchedule):
    """Rises linearly to `peak` over `warmup_steps`, then follows `after` shifted by them."""

    def __init__(self, peak, warmup_steps, after):
        self.peak, self.warmup_steps, self.after = peak, warmup_steps, after

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        warm = self.peak * (step + 1.0) / float(self.warmup_steps)
        return tf.where(step < self.warmup_steps, warm,
                        tf.cast(self.after(step - self.warmup_steps), tf.float32))

    def get_config(self):
        return {"peak": self.peak, "warmup_steps": self.warmup_steps,
                "after": schedules.serialize(self.after)}

    @classmethod
    def from_config(cls, serialized):
        return cls(serialized["peak"], serialized["warmup_steps"],
                   schedules.deserialize(serialized["after"]))


@keras.saving.register_keras_serializable(package="mgloop")
class Constant(schedules.LearningRateSchedule):
    """lr(step) = `rate`, as a constant of the traced step: no op runs for it (Keras's
    constant PolynomialDecay, end = start, gives the same float after nine ops a step)."""

    def __init__(self, rate):
        self.rate = rate

    def __call__(self, step):
        return tf.constant(self.rate, tf.float32)

    def get_config(self):
        return {"rate": self.rate}


def make_schedule(options: OptimOptions, train_steps: int) -> schedules.LearningRateSchedule:
    """The learning rate of --lr_schedule as a function of the updates applied (module
    docstring), over a run of `train_steps` updates."""
    lr = options.learning_rate
    decay_steps = max(train_steps - options.warmup_steps, 1)
    if options.lr_schedule == "poly":
        after = schedules.PolynomialDecay(lr, decay_steps, end_learning_rate=0.0,
                                          power=options.lr_power)
    elif options.lr_schedule == "cosine":
        after = schedules.CosineDecay(lr, decay_steps, alpha=0.0)
    else:
        after = Constant(lr)
    if options.warmup_steps:
        return LinearWarmup(lr, options.warmup_steps, after)
    return after


def compiled_schedule(schedule: schedules.LearningRateSchedule):
    """`schedule` traced once as a function of an int64 step: returns step -> float.

    Calling a Keras schedule eagerly on a Python int keeps about 0.6 KiB of host memory
    per new step that TensorFlow never frees (its cache of converted Python scalars);
    the compiled function, given the step as a numpy int64, keeps none.
    """
    compiled = tf.function(lambda step: tf.cast(schedule(step), tf.float32),
                           input_signature=[tf.TensorSpec([], tf.int64)], autograph=False)
    return lambda step: float(compiled(np.asarray(step, np.int64)))


def make_optimizer(options: OptimOptions, train_steps: int,
                   output_kernels: tuple[str, ...] = ()) -> keras.optimizers.Optimizer:
    """A fresh optimizer for one variable copy, its rate `make_schedule`'s; muon's AdamW
    part also takes the weights whose paths are `output_kernels` (muon.py)."""
    schedule = make_schedule(options, train_steps)
    if options.optimizer == "muon":
        return muon.make(options, schedule, output_kernels)
    decay = options.weight_decay or None
    if options.optimizer == "adam":
        return keras.optimizers.Adam(schedule, epsilon=options.adam_epsilon, weight_decay=decay)
    momentum = options.momentum if options.optimizer == "momentum" else 0.0
    return keras.optimizers.SGD(schedule, momentum=momentum, weight_decay=decay)


@dataclasses.dataclass(frozen=True)
class FlagOptimizer:
    """The flags' optimizer factory: each call a fresh `make_optimizer`; `for_model(model)`
    the same knowing the model's output layer (muon's AdamW part takes it: muon.py;
    training_spec.resolve calls it on the template)."""

    options: OptimOptions
    train_steps: int
    output_kernels: tuple[str, ...] = ()

    def __call__(self) -> keras.optimizers.Optimizer:
        return make_optimizer(self.options, self.train_steps, self.output_kernels)

    def for_model(self, model: keras.Model) -> "FlagOptimizer":
        if self.options.optimizer != "muon":
            return self
        return dataclasses.replace(self, output_kernels=muon.output_kernels(model))


def colocate_with_variables(optimizer: keras.optimizers.Optimizer, place: bool = True) -> None:
    """Makes `optimizer` create each slot, and run each update, on its variable's device
    (unless not `place`: where it is built), and record its slots by variable
    (`optimizer.mgloop_slots`: id(variable) -> its slots in the order made; what a sharded
    update gathers and scatters, step/sharded_update.py).

    Keras optimizers create slots through `add_variable_from_reference` and
    update one variable at a time through `update_step`; both are wrapped on
    this instance so that, whatever the layout (even variables spread over
    devices), a variable, its slots and its update math share a device.
    """
    add_slot, update = optimizer.add_variable_from_reference, optimizer.update_step
    optimizer.mgloop_slots = {}

    def add_variable_from_reference(reference_variable, *args, **kwargs):
        with tf.device(reference_variable.device) if place else contextlib.nullcontext():
            slot = add_slot(reference_variable, *args, **kwargs)
        optimizer.mgloop_slots.setdefault(id(reference_variable), []).append(slot)
        return slot

    def update_step(gradient, variable, learning_rate):
        with tf.device(variable.device):
            return update(gradient, variable, learning_rate)

    optimizer.add_variable_from_reference = add_variable_from_reference
    optimizer.update_step = update_step


def fused_sgd(optimizer: keras.optimizers.Optimizer):
    """Keras's SGD `update_step` as TensorFlow's own one-kernel-per-variable training ops, or
    None for any other optimizer (an SGD subclass with its own `update_step` included).

    Keras's SGD (keras/src/optimizers/sgd.py) updates v with momentum mu and rate lr as

        m <- m mu - g lr;   v <- v + m         (nesterov: v <- v + m mu - g lr)
        v <- v - g lr                           (mu = 0)

    in five ops a variable (with momentum: two products and a difference, each writing a
    temporary as large as the variable, and two assignments). `ResourceApplyKerasMomentum` and `ResourceApplyGradientDescent` compute the
    same float operations in the same order in one pass: the same result (each product
    and sum rounded once; tests/test_optim.py checks it within that bound), in half the time on
    a 41M-parameter variable and one op instead of five (docs/results/towers.md).
    Gradients that are not dense tensors (IndexedSlices) take Keras's own update."""
    if (not isinstance(optimizer, keras.optimizers.SGD)
            or type(optimizer).update_step is not keras.optimizers.SGD.update_step):
        return None
    keras_update = optimizer.update_step

    def update_step(gradient, variable, learning_rate):
        if not isinstance(gradient, tf.Tensor):
            return keras_update(gradient, variable, learning_rate)
        dtype = variable.dtype
        rate, gradient = tf.cast(learning_rate, dtype), tf.cast(gradient, dtype)
        handle = backing(variable).handle
        if optimizer.momentum == 0:
            return tf.raw_ops.ResourceApplyGradientDescent(var=handle, alpha=rate,
                                                           delta=gradient)
        slot = optimizer.momentums[optimizer._get_variable_index(variable)]
        return tf.raw_ops.ResourceApplyKerasMomentum(
            var=handle, accum=backing(slot).handle, lr=rate, grad=gradient,
            momentum=tf.cast(optimizer.momentum, dtype), use_nesterov=optimizer.nesterov)
    return update_step


def build_optimizers(copies: list[VariableCopy], optimizer_fn, decided=None) -> None:
    """Creates each copy's optimizer (step counter on the copy's device, slots beside
    their variables; Keras's SGD updating through `fused_sgd`) before tracing. Copy 0's
    optimizer decides which variables decay (`decays`); every other copy's decays
    exactly the corresponding ones (`decaying_like`: by identity, whatever the names).
    `decided[c][i]`, if given: whether copy c's optimizer decays its variable i (the
    sharded update's pieces, each decided as copy 0 decides its whole variable). A Muon's
    AdamW part likewise: copy 0's decides (muon.adamw_part), every copy is told it."""
    split = None  # Muon: whether copy 0's optimizer gives each variable to its AdamW part
    for c, copy in enumerate(copies):
        with tf.device(copy.device):
            optimizer = optimizer_fn()
            if decided is not None:  # (not a Muon: sharded_update.check_optimizer)
                decaying_like(optimizer, copy.trainable, decided[c])
            elif c == 0:  # copy 0: the template's variables, as the user named them
                decided_0 = decays(optimizer, copy.trainable)
                _warn_if_names_decide_otherwise(optimizer, copy.trainable)
                split = muon.adamw_part(optimizer, copy.trainable)
            else:
                decaying_like(optimizer, copy.trainable, decided_0)
            if split is not None:
                muon.splitting_like(optimizer, copy.trainable, split)
            copy.optimizer = optimizer
            fused = fused_sgd(copy.optimizer)
            if fused is not None:  # Keras's SGD: the same update in TensorFlow's kernels
                copy.optimizer.update_step = fused
            colocate_with_variables(copy.optimizer)
            copy.optimizer.build(copy.trainable)
            if split is not None:
                muon.check_split(copy.optimizer, copy.trainable, split)


def decays(optimizer: keras.optimizers.Optimizer, variables) -> list[bool]:
    """Whether `optimizer` decays each of `variables`, by its own rule (Keras's
    `_use_weight_decay`: False when the variable's id is among exclude_from_weight_decay's
    var_list or a var_names pattern is found (re.search) in its name; Keras reads it only
    when weight_decay is set)."""
    return [bool(optimizer._use_weight_decay(v)) for v in variables]


def _warn_if_names_decide_otherwise(optimizer, variables) -> None:
    """Logs (a warning) the variables that a var_names pattern of `optimizer` decides
    otherwise on their paths ("mlp/dense/bias:0": what mgloop's copy 0 holds) than on Keras
    3's short names ("bias": what a Keras model's `fit` would match)."""
    pattern = getattr(optimizer, "_exclude_from_weight_decay_pattern", None)
    if (pattern is None or optimizer.weight_decay is None
            or type(optimizer)._use_weight_decay
            is not keras.optimizers.Optimizer._use_weight_decay):
        return
    listed = getattr(optimizer, "_exclude_from_weight_decay", None) or set()
    otherwise = [v.name for v in variables if optimizer._var_key(v) not in listed
                 and (re.search(pattern, v.name) is None)
                 != (re.search(pattern, v.name.split(":")[0].rsplit("/", 1)[-1]) is None)]
    if otherwise:
        logging.warning(
            "exclude_from_weight_decay(var_names=%r) is matched against the variables' paths; "
            "it decides %d of them (%s) otherwise than on Keras's short names, which a "
            "Keras model's fit matches", pattern.pattern, len(otherwise),
            ", ".join(otherwise[:3]) + (", ..." if len(otherwise) > 3 else ""))


def decaying_like(optimizer: keras.optimizers.Optimizer, variables, decided) -> None:
    """Makes `optimizer` (not built) decay variables[i] exactly when decided[i], by identity
    (`exclude_from_weight_decay(var_list=the others)`: its own var_list and var_names
    replaced, so no name matters). Refuses (one line) an optimizer already built (a factory
    returning one object for every copy) or one whose own `_use_weight_decay` still decides
    otherwise (a rule of its own, not Keras's exclusions)."""
    if getattr(optimizer, "built", False):
        raise ConfigError(f"optimizer: the factory returned a {type(optimizer).__name__} "
                          "already built (one object for every copy?); return a new "
                          "optimizer from each call")
    optimizer.exclude_from_weight_decay(
        var_list=[v for v, decay in zip(variables, decided) if not decay])
    if optimizer.weight_decay is None:
        return
    differs = [v.name for v, decay, now in zip(variables, decided, decays(optimizer, variables))
               if decay != now]
    if differs:
        raise ConfigError(
            f"optimizer: {type(optimizer).__name__}'s _use_weight_decay decides weight decay "
            f"by its own rule, not Keras's exclusions, and decides {differs[0]} of a copy "
            "unlike the template's variable; exclude variables with "
            "exclude_from_weight_decay(var_list=..., var_names=...), or train on one device")


def apply_updates(copies: list[VariableCopy], grads_per_copy: list[list[tf.Tensor]]) -> None:
    """Copy c applies grads_per_copy[c] (already averaged and on its device)."""
    for copy, grads in zip(copies, grads_per_copy):
        with tf.device(copy.device):
            copy.optimizer.apply(grads, copy.trainable)


def current_rate(optimizer: keras.optimizers.Optimizer):
    """step -> the rate `optimizer` applies at its current iteration (a user's optimizer:
    its float, or its LearningRateSchedule at `optimizer.iterations`, which counts the
    updates applied; the step argument is for the summaries' interface)."""
    return lambda step: float(np.asarray(optimizer.learning_rate))
