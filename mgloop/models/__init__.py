"""Model zoo: plain Keras 3 models, looked up by `--model` name.

A builder takes `(input_shape, num_classes)` and returns an uncompiled Keras
model that outputs logits and uses only built-in Keras layers, so the exported
file loads with `keras.models.load_model` without mgloop installed.

May import: ground modules and data/.
"""


import importlib
import importlib.util

_BODY = "mgloop.models.registry"


def __getattr__(name):
    """Everything but mgloop.models.options is loaded on first use from registry.py, so that
    importing `mgloop.models.options` (a settings part: plain Python) loads no TensorFlow."""
    if name.startswith("__"):
        raise AttributeError(name)
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a module of the package
        return importlib.import_module(f"{__name__}.{name}")
    body = importlib.import_module(_BODY)
    try:
        return getattr(body, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
