"""The body of mgloop.models (its package module loads it on first use; see there).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import keras

from mgloop.errors import ConfigError
from mgloop.settings import choice, in_range

ModelBuilder = Callable[[tuple, int], keras.Model]
_REGISTRY: dict[str, ModelBuilder] = {}
_SETTINGS: dict[str, tuple[str, ...]] = {}  # model -> the Config fields its builder takes
_CHECKS: dict[str, Callable] = {}  # model -> its check of those settings' combination


def register(name: str, settings: tuple[str, ...] = (), check: Callable | None = None):
    """`settings`: Config fields (default None) the builder takes as keyword arguments;
    set for another model, they are refused (check_settings). `check(config)` refuses a
    bad combination of them (ConfigError, one line)."""
    def decorate(builder: ModelBuilder) -> ModelBuilder:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is registered twice")
        _REGISTRY[name] = builder
        _SETTINGS[name] = tuple(settings)
        if check is not None:
            _CHECKS[name] = check
        return builder
    return decorate


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> ModelBuilder:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"--model={name!r} is not one of: {', '.join(names())}") from None


def check_settings(config) -> None:
    """--model names a registered model; another model's settings are not set."""
    choice("model", config.model, names())
    for model, fields in _SETTINGS.items():
        for field in fields:
            value = getattr(config, field)
            if model != config.model and value is not None:
                raise ConfigError(f"--{field}={value} is set but only --model={model} reads "
                                  f"it, not --model={config.model}; drop --{field}")
            if model == config.model and value is not None:
                in_range(field, value, low=1)
    if config.model in _CHECKS:
        _CHECKS[config.model](config)


def resolved_settings(config) -> dict:
    """--model's own settings with the builder's defaults filled in where None (the values
    a run records); other models' settings stay None."""
    parameters = inspect.signature(get(config.model)).parameters
    return {f: parameters[f].default if getattr(config, f) is None else getattr(config, f)
            for f in _SETTINGS[config.model]}


def builder_of(config, input_shape: tuple, num_classes: int) -> Callable[[], keras.Model]:
    """`--model`'s builder for the data, with the model's own settings that are set."""
    settings = {f: getattr(config, f) for f in _SETTINGS[config.model]
                if getattr(config, f) is not None}
    return functools.partial(get(config.model), input_shape, num_classes, **settings)


from mgloop.models import big_mlp  # noqa: E402,F401
from mgloop.models import cnn  # noqa: E402,F401
from mgloop.models import minigooglenet  # noqa: E402,F401
from mgloop.models import mlp  # noqa: E402,F401
from mgloop.models import resnet20  # noqa: E402,F401
from mgloop.models import transformer_lm  # noqa: E402,F401
