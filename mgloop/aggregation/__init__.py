"""Gradient aggregation methods, one small module each, looked up by name.

A method is chosen with a spec string, `NAME` or `NAME:key=value,...`
(options.py): `parse(spec)` gives its class and options, `make(spec, devices,
transport_dtype)` the method itself. Adding a method: subclass `Aggregation`,
decorate it with `@register` (in a module of this package imported below, or in
your own module loaded with `--plugin`, plugins.py). Its name becomes a valid
`--aggregation` value. What every method must do and declare: base.py and the
docs/concepts/aggregation-contract.md.

The contract, the lookup, the settings, traffic and validation, here:

    base.py           the contract: where variable copies live and how gradients meet
    capabilities.py   what a method can do, one record (`Capabilities`) each method declares
    registry.py       the package's body (`register`, `parse`, `make`), loaded on first use
    options.py        a method and its options as one string; exchange_options.py the
                      aggregation part of the settings (`config.exchange`), checks.py its check
    plugins.py        `--plugin=MODULE`: a user's module imported before validation
    validation.py     which settings combine with a method, from its declared capabilities;
                      node_settings.py, shard_settings.py the checks of --nodes, --shard_update
    global_models.py  the model a method produces: evaluated, exported, returned
    traffic.py, measured.py  bytes and messages per device and step; bytes counted at run time

The methods, by family (one module each; their spec strings in the module docstrings):

    dense/            every tower's whole gradient every step: parameter servers, all-reduces
    local/            local updates: local SGD, the DiLoCo family, DES-LOC, NoLoCo, SPARTA
    robust/           robust rules against Byzantine towers
    compression/      lossy compressed exchanges with error feedback (topk, powersgd, ...)

Where they run and what they share:

    placement/        towers per device, nodes, workers, peers, live sets, shards
    kernels/          packing, bit-packing, sorting, stacked rows, chunked top-k

Old names, each warning (DeprecationWarning) until mgloop 0.2: nodes.py
(placement/between_nodes.py); the modules that moved into the folders above: docs/moved.md.

May import: ground modules, cluster/ (devices, workers, node_layout: the nodes' topology), training/
(variable copies). Never step/ or runs/: the step hands a method its towers' gradients, not
the other way round.
"""

from mgloop import lazy_package

# Everything but the settings part (mgloop.aggregation.exchange_options, plain Python) is
# loaded on first use from registry.py.
__getattr__ = lazy_package.getattr_of(__name__, "mgloop.aggregation.registry")
