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

from mgloop import lazy_package

# Everything but the settings part (mgloop.aggregation.exchange_options, plain Python) is
# loaded on first use from registry.py.
__getattr__ = lazy_package.getattr_of(__name__, "mgloop.aggregation.registry")
