"""Gradient aggregation methods, one small module each, looked up by name.

A method is chosen with a spec string, `NAME` or `NAME:key=value,...`
(options.py): `parse(spec)` gives its class and options, `make(spec, devices,
transport_dtype)` the method itself. Adding a method: subclass `Aggregation`,
decorate it with `@register` (in a module of this package imported below, or in
your own module loaded with `--plugin`, plugins.py). Its name becomes a valid
`--aggregation` value. What every method must do and declare: base.py and the
docs/concepts/aggregation-contract.md.

May import: ground modules, cluster/ (devices, workers, node_layout: the nodes' topology), training/
(variable copies). Never step/ or runs/: the step hands a method its towers' gradients, not
the other way round.
"""


import importlib
import importlib.util

_BODY = "mgloop.aggregation.registry"


def __getattr__(name):
    """Everything but mgloop.aggregation.exchange_options is loaded on first use from registry.py, so that
    importing `mgloop.aggregation.exchange_options` (a settings part: plain Python) loads no TensorFlow."""
    if name.startswith("__"):
        raise AttributeError(name)
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a module of the package
        return importlib.import_module(f"{__name__}.{name}")
    body = importlib.import_module(_BODY)
    try:
        return getattr(body, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
