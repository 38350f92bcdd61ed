"""What a run trains with: its loss, metrics and optimizer, from the run, the model, or flags.

Each of the three is taken from the first place that gives it:

    1. the argument of `mgloop.run` (loss=, metrics=, optimizer=);
    2. the template model, if `model_fn` compiled it (`model.compile(loss=, loss_weights=,
       metrics=, optimizer=)`);
    3. mgloop's default: the cross-entropy matched to the output (losses.py), accuracy
       where that loss defines one (metrics.py), and the flag-driven optimizer
       (--optimizer, --learning_rate, --lr_schedule, ...: optim.py; muon's AdamW part
       given the template's output layer: muon.py);

and one log line per run says which was used. A loss is a callable (y, outputs) -> loss
per example (or already a mean), a Keras loss name, or, for a model with several
outputs, a list or dict of them (losses.PerOutput; compile's loss_weights apply). Metrics
are a list (one output) or a dict/list of lists (per output) of keras.metrics.Metric
objects, Keras metric names, or mgloop metric objects (metrics.py); "accuracy" is
mgloop's accuracy by the output's loss (accuracy.py). An optimizer is a
keras.optimizers.Optimizer object (its learning rate a float or a
keras.optimizers.schedules.LearningRateSchedule), a Keras optimizer name, or a factory
(no arguments, returns one): every variable copy gets its own optimizer, made from the
object's config (`from_config(get_config())`) or by calling the factory, so the copies
start from the same state and apply the same updates. Keras's config leaves out an
object's weight-decay exclusions (`exclude_from_weight_decay`), so they are carried to
every optimizer made from it: its var_names patterns as they are, its var_list mapped to
the template's variables (one that is not the template's is refused in one line, as is a
factory's: no copy has it). Which variables decay is then copy 0's optimizer's decision,
told to every other copy by identity (optim.build_optimizers).

Compiled settings mgloop cannot honour (weighted_metrics) are refused in one line.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from absl import logging
import keras

from mgloop.errors import ConfigError
from mgloop.training import losses
from mgloop.training import metrics as metrics_lib
from mgloop.training import optim
from mgloop.training import perplexity

_ACCURACY_NAMES = ("accuracy", "acc")


@dataclasses.dataclass
class Spec:
    loss_fn: Callable
    metrics: list
    optimizer_fn: Callable[[], keras.optimizers.Optimizer]
    sources: dict[str, str]  # "loss", "metrics", "optimizer" -> "run", "compiled model", "default"


def check_arguments(loss, metrics, optimizer, callbacks) -> None:
    """The run's own arguments, by type, before any device exists (one line each)."""
    if loss is not None and not (callable(loss) or isinstance(loss, (str, list, tuple, dict))):
        raise ConfigError(f"loss: got {type(loss).__name__}; give a callable (y, outputs) -> "
                          "loss, a Keras loss name, or a list/dict of them per output")
    if metrics is not None and not isinstance(metrics, (list, tuple, dict)):
        raise ConfigError(f"metrics: got {type(metrics).__name__}; give a list of metrics "
                          "(keras.metrics objects or names), or a dict/list of lists per output")
    if optimizer is not None and not (isinstance(optimizer, (keras.optimizers.Optimizer, str))
                                      or callable(optimizer)):
        raise ConfigError(f"optimizer: got {type(optimizer).__name__}; give a "
                          "keras.optimizers.Optimizer, its name, or a function returning one")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ConfigError("optimizer: a LossScaleOptimizer; give its inner optimizer and "
                          "--mixed_precision=mixed_float16 (mgloop scales the loss per copy)")
    for callback in callbacks or ():
        if not callable(callback):
            raise ConfigError(f"callbacks: {callback!r} is not callable; give functions "
                              "(step, metrics) -> stop? such as "
                              "mgloop.runs.callbacks.EarlyStopping")


def compiled_settings(model: keras.Model) -> dict:
    """loss, loss_weights, metrics, optimizer as `model.compile` was given them (the
    optimizer as Keras resolved it); {} for a model that was not compiled."""
    config = getattr(getattr(model, "_compile_config", None), "config", None)
    if not getattr(model, "compiled", False) or not config:
        return {}
    if config.get("weighted_metrics"):
        raise ConfigError("model_fn: the model is compiled with weighted_metrics, which "
                          "mgloop does not take (no sample weights); give them as metrics")
    return {"loss": config.get("loss"), "loss_weights": config.get("loss_weights"),
            "metrics": config.get("metrics"),
            "optimizer": getattr(model, "optimizer", None) or config.get("optimizer")}


def _check_several_outputs(model: keras.Model, what: str) -> None:
    """Refuses a per-output `what` for a Functional/Sequential model with one output."""
    try:
        count = len(model.outputs) if getattr(model, "outputs", None) is not None else None
    except (AttributeError, ValueError):  # a subclassed model: checked when traced
        count = None
    if count == 1:
        raise ConfigError(f"{what}: given per output (a list or dict), but the model has one "
                          f"output; give {what} for that output alone")


def make_loss(loss, model: keras.Model, weights=None):
    """A callable loss from a run's or compile's `loss` (see the module docstring)."""
    if isinstance(loss, (list, tuple, dict)):
        _check_several_outputs(model, "loss")
        return losses.PerOutput(loss, weights, model)
    if weights is not None:
        raise ConfigError("loss_weights: given for one loss; they weigh a loss per output: "
                          "leave loss_weights out, or give a loss per output")
    return keras.losses.get(loss) if isinstance(loss, str) else loss


def _one_metric(item, loss_fn, output: losses.OutputKey | None):
    prefix = f"{output.name}_" if output is not None else ""
    term = loss_fn
    if output is not None and isinstance(loss_fn, losses.PerOutput):
        term = next((t for k, t, _ in loss_fn.terms if k == output), None)
    if isinstance(item, str) and item in _ACCURACY_NAMES:
        accuracy = metrics_lib.default_metrics(term) if term is not None else []
        if not accuracy:
            raise ConfigError(f"metrics: {item!r} on output {prefix or 'of the model'} is not "
                              f"defined by its loss {term!r}; give a keras.metrics object "
                              "(e.g. BinaryAccuracy(threshold=...))")
        return metrics_lib.Accuracy(accuracy[0].loss_fn, output, f"{prefix}accuracy")
    if isinstance(item, str):
        item = keras.metrics.get(item)
        if isinstance(item, type):
            item = item()
        elif not isinstance(item, keras.metrics.Metric):
            item = keras.metrics.MeanMetricWrapper(item, name=item.__name__)
    if isinstance(item, keras.metrics.Metric):
        return metrics_lib.KerasMetric(item, output, prefix + item.name)
    if all(hasattr(item, a) for a in ("name", "size", "counts", "result")):
        return item  # an mgloop metric (metrics.py), as given
    raise ConfigError(f"metrics: {item!r} is neither a keras.metrics.Metric, a Keras metric "
                      "name, nor an mgloop metric (name, size, counts, result); give one "
                      "of those")


def make_metrics(given, loss_fn, model: keras.Model) -> list:
    """mgloop metric objects of a run's or compile's `metrics`, each name once."""
    if isinstance(given, dict) or (given and all(isinstance(m, (list, tuple)) for m in given)):
        _check_several_outputs(model, "metrics")
        names = list(given) if isinstance(given, dict) else list(range(len(given)))
        lists = list(given.values()) if isinstance(given, dict) else list(given)
        keys = losses.output_keys(model, names)
        made = [_one_metric(m, loss_fn, key) for key, items in zip(keys, lists)
                for m in ([items] if not isinstance(items, (list, tuple)) else items or [])]
    else:
        made = [_one_metric(m, loss_fn, None) for m in given]
    names = [m.name for m in made]
    repeated = sorted({n for n in names if names.count(n) > 1} | ({"loss"} & set(names)))
    if repeated:
        raise ConfigError(f"metrics: the names {repeated} are used twice (or are 'loss'); give "
                          "each metric its own name (name=...)")
    return made


def optimizer_factory(optimizer, model: keras.Model | None = None
                      ) -> Callable[[], keras.optimizers.Optimizer]:
    """A function making one fresh optimizer per variable copy (see the module docstring);
    an object's weight-decay exclusions carried (`_exclusions`, against `model`'s
    variables)."""
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer  # compile's auto_scale_loss: mgloop scales
    if isinstance(optimizer, keras.optimizers.Optimizer):
        kind = type(optimizer)
        var_list, var_names = _exclusions(optimizer, model, "the optimizer object's")
        try:
            config = optimizer.get_config()
            schedule = getattr(optimizer, "_learning_rate", None)  # Keras keeps the object there
            if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
                config["learning_rate"] = schedule  # shared: a function of the step alone
            kind.from_config(dict(config))
        except Exception as error:  # noqa: BLE001 -- any failure: one line, before any copy
            raise ConfigError(f"optimizer: {kind.__name__} cannot be remade from its config "
                              f"({type(error).__name__}: {str(error).splitlines()[0][:120]}); "
                              "give a factory that returns a fresh optimizer") from None

        def remake():
            made = kind.from_config(dict(config))
            if var_list or var_names:  # what get_config leaves out
                made.exclude_from_weight_decay(var_list=var_list, var_names=var_names)
            return made
        return remake

    def make():
        made = optimizer()
        if not isinstance(made, keras.optimizers.Optimizer):
            raise ConfigError(f"optimizer: the factory {optimizer!r} returned "
                              f"{type(made).__name__}, not a keras.optimizers.Optimizer; "
                              "give a function that returns one")
        return made
    return make


def _exclusions(optimizer: keras.optimizers.Optimizer, model: keras.Model | None,
                whose: str) -> tuple[list, list[str] | None]:
    """(var_list, var_names) of `optimizer`'s exclude_from_weight_decay: the template's
    variables among its var_list (Keras keeps their ids only), its patterns as one. Refuses
    (one line) a var_list variable that is not `model`'s: no copy has it, so it would
    exclude nothing, silently."""
    keys = set(getattr(optimizer, "_exclude_from_weight_decay", None) or ())
    pattern = getattr(optimizer, "_exclude_from_weight_decay_pattern", None)
    known = {optimizer._var_key(v): v for v in (model.variables if model is not None else ())}
    foreign = keys - known.keys()
    if foreign:
        raise ConfigError(
            f"optimizer: {whose} exclude_from_weight_decay(var_list=...) names {len(foreign)} "
            "variable(s) that are not the template model's, which no copy has; exclude "
            "them by name (var_names=...), or the template's own variables")
    var_list = [v for key, v in known.items() if key in keys]
    return var_list, ([pattern.pattern] if pattern is not None else None)


def resolve(model: keras.Model, loss, metrics, optimizer, default_loss,
            default_optimizer_fn, input_shape=None) -> Spec:
    """The Spec of a template model (see the module docstring): `loss`, `metrics`,
    `optimizer` as the run gives them (None: the compiled model's, else the defaults)."""
    compiled = compiled_settings(model)
    sources = {}
    if loss is not None:
        loss_fn, sources["loss"] = make_loss(loss, model), "run"
    elif compiled.get("loss") is not None:
        loss_fn = make_loss(compiled["loss"], model, compiled.get("loss_weights"))
        sources["loss"] = "compiled model"
    else:
        loss_fn, sources["loss"] = default_loss, "default"
    loss_fn = losses.for_model(loss_fn, model, input_shape)  # the default: its output's
    if metrics is not None:
        made, sources["metrics"] = make_metrics(metrics, loss_fn, model), "run"
    elif compiled.get("metrics"):
        made, sources["metrics"] = make_metrics(compiled["metrics"], loss_fn, model), \
            "compiled model"
    else:
        made = metrics_lib.default_metrics(loss_fn) + perplexity.for_sequences(loss_fn, model)
        sources["metrics"] = "default"
    if optimizer is not None:
        optimizer_fn, sources["optimizer"] = optimizer_factory(optimizer, model), "run"
    elif compiled.get("optimizer") is not None:
        optimizer_fn = optimizer_factory(compiled["optimizer"], model)
        sources["optimizer"] = "compiled model"
    else:
        optimizer_fn, sources["optimizer"] = default_optimizer_fn, "default (flags)"
        if isinstance(optimizer_fn, optim.FlagOptimizer):  # muon: its AdamW part takes
            optimizer_fn = optimizer_fn.for_model(model)  # the output layer (muon.py)
    if sources["optimizer"] != "default (flags)":  # a factory's var_list: before any copy
        _exclusions(optimizer_fn(), model, "the optimizer's")
    logging.info("training with loss %r (%s), metrics %s (%s), optimizer from %s", loss_fn,
                 sources["loss"], [m.name for m in made], sources["metrics"],
                 sources["optimizer"])
    return Spec(loss_fn, made, optimizer_fn, sources)


@dataclasses.dataclass
class Given:
    """What `mgloop.run` was given (None: not given)."""

    loss: object = None
    metrics: object = None
    optimizer: object = None
    callbacks: object = None
    hooks: tuple = ()  # the user's step hooks (mgloop.step.hooks.Hook), after mgloop's
