"""Model zoo: plain Keras 3 models, looked up by `--model` name.

A builder takes `(input_shape, num_classes)` and returns an uncompiled Keras
model that outputs logits and uses only built-in Keras layers, so the exported
file loads with `keras.models.load_model` without mgloop installed.
"""

from __future__ import annotations

from typing import Callable

import keras

from mgloop.errors import ConfigError
from mgloop.settings import choice

ModelBuilder = Callable[[tuple, int], keras.Model]
_REGISTRY: dict[str, ModelBuilder] = {}


def register(name: str):
    def decorate(builder: ModelBuilder) -> ModelBuilder:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} is registered twice")
        _REGISTRY[name] = builder
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
    """--model names a registered model."""
    choice("model", config.model, names())


from mgloop.models import big_mlp  # noqa: E402,F401
from mgloop.models import cnn  # noqa: E402,F401
from mgloop.models import minigooglenet  # noqa: E402,F401
from mgloop.models import mlp  # noqa: E402,F401
from mgloop.models import resnet20  # noqa: E402,F401
