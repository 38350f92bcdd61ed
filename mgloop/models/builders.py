"""The models by name: `register` (a builder's decorator), `names`, `get`, and the checks
of the models part's settings against the registered builders (models/checks.py calls them).

The table only: the built-in models register themselves here when registry.py, the body of
mgloop.models, imports them; so this module imports none of them, and they import it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import keras

from mgloop.errors import ConfigError
from mgloop.models.options import ModelOptions
from mgloop.settings import choice, in_range

ModelBuilder = Callable[[tuple, int], keras.Model]
_REGISTRY: dict[str, ModelBuilder] = {}
_SETTINGS: dict[str, tuple[str, ...]] = {}  # model -> the ModelOptions fields its builder takes
_CHECKS: dict[str, Callable] = {}  # model -> its check of those settings' combination
_SEQUENCES: set[str] = set()  # the models that read sequences of tokens


def register(name: str, settings: tuple[str, ...] = (), check: Callable | None = None,
             sequences: bool = False):
    """`settings`: ModelOptions fields (default None) the builder takes as keyword
    arguments; set for another model, they are refused (check_model_sizes).
    `check(options)` refuses a bad combination of them (ConfigError, one line).
    `sequences`: the model reads sequences of tokens, so a --dataset without them is
    refused (check_data)."""
    def decorate(builder: ModelBuilder) -> ModelBuilder:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is registered twice")
        _REGISTRY[name] = builder
        _SETTINGS[name] = tuple(settings)
        if check is not None:
            _CHECKS[name] = check
        if sequences:
            _SEQUENCES.add(name)
        return builder
    return decorate


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> ModelBuilder:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"--model={name!r} is not one of: {', '.join(names())}") from None


def check_model_sizes(options: ModelOptions) -> None:
    """--model names a registered model; another model's settings are not set."""
    choice("model", options.model, names())
    for model, fields in _SETTINGS.items():
        for field in fields:
            value = getattr(options, field)
            if model != options.model and value is not None:
                raise ConfigError(f"--{field}={value} is set but only --model={model} reads "
                                  f"it, not --model={options.model}; drop --{field}")
            if model == options.model and value is not None:
                in_range(field, value, low=1)
    if options.model in _CHECKS:
        _CHECKS[options.model](options)


def check_data(options: ModelOptions, dataset: str, sequence_length: int | None) -> None:
    """Refuses a model that reads sequences of tokens on a --dataset that gives none
    (`sequence_length` None: the dataset's examples are not sequences)."""
    if options.model in _SEQUENCES and sequence_length is None:
        raise ConfigError(f"--model={options.model} reads sequences of tokens, which "
                          f"--dataset={dataset} does not give; use --dataset=text "
                          "or --dataset=python_text")


def resolved_settings(options: ModelOptions) -> dict:
    """--model's own settings with the builder's defaults filled in where None (the values
    a run records); other models' settings stay None."""
    parameters = inspect.signature(get(options.model)).parameters
    own = {f: getattr(options, f) for f in _SETTINGS[options.model]}
    return {f: parameters[f].default if value is None else value for f, value in own.items()}


def builder_of(options: ModelOptions, input_shape: tuple,
               num_classes: int) -> Callable[[], keras.Model]:
    """`--model`'s builder for the data, with the model's own settings that are set."""
    settings = {f: getattr(options, f) for f in _SETTINGS[options.model]
                if getattr(options, f) is not None}
    return functools.partial(get(options.model), input_shape, num_classes, **settings)
