"""Gradient aggregation methods, one small module each, looked up by name.

A method is chosen with a spec string, `NAME` or `NAME:key=value,...`
(options.py): `parse(spec)` gives its class and options, `make(spec, devices,
transport_dtype)` the method itself. Adding a method: subclass `Aggregation`,
decorate it with `@register` (in a module of this package imported below, or in
your own module loaded with `--plugin`, plugins.py). Its name becomes a valid
`--aggregation` value. What every method must do and declare: base.py and the
docs/concepts/aggregation-contract.md.

The machinery every method shares:

    base.py           the contract: where variable copies live and how gradients meet
    registry.py       the package's body (`register`, `parse`, `make`), loaded on first use
    options.py        a method and its options as one string; exchange_options.py the
                      aggregation part of the settings (`config.exchange`), checks.py its check
    plugins.py        `--plugin=MODULE`: a user's module imported before validation
    validation.py     which settings combine with a method, from its declared capabilities;
                      node_settings.py, shard_settings.py the checks of --nodes, --shard_update
    wrapper.py        a method around another one, presenting it on more towers
    device_groups.py  several towers per device, one copy per device; stacked_rows.py the
                      rows of their stacked gradients
    between_nodes.py  the method between simulated nodes, an exact sum within each
    cross_worker.py   the local method inside each worker, then a collective between them
    collective_keys.py  the group and instance keys of TensorFlow's collectives, one place
    peers.py          the method between worker processes, one node leader per worker
    node_failures.py  simulated nodes that leave and return (torchft's quorum);
                      live_exchange.py the exchange over the live nodes only
    global_models.py  the model a method produces: evaluated, exported, returned
    placement_queries.py  what runs/ asks a method about where it runs (towers per node,
                      the nodes' failures, a worker's own node state)
    traffic.py, measured.py  bytes and messages per device and step; bytes counted at run time
    packing.py        small tensors fused into buckets (`--pack_bytes`); bitpacking.py
                      compressed payloads packed into uint8
    gather_at_root.py the transport of methods that need every tower's whole gradient
    shard_exchange.py the exchange of a sharded update: reduce-scatter, then all-gather
    sorting_network.py  order statistics along the towers' axis, compiled with XLA

The methods, one module each (their spec strings in the module docstrings):

    parameter_server.py, stale.py   one shared copy (`ps`...), `delay` and `drop` towers
    colocate.py       the single-loss baseline of Keras `multi_gpu_model`
    ring.py, collective.py, reduce_broadcast.py, hierarchical.py, adasum.py   all-reduces
    independent.py    replicated variables, no exchange
    local_steps.py    `localsgd`, `diloco`; outer_schedule.py their outer momentum schedule
    streaming_diloco.py  DiLoCo on one fragment at a time; overlap.py when the fragment's
                      outer step is used, outer_formats.py how its outer gradients travel
    async_diloco.py   DiLoCo for nodes of different speeds; async_clock.py its schedule,
                      async_run.py its run glue (--node_speeds, its staleness reported)
    des_loc.py, noloco.py, sparta.py  local Adam; no all-reduce; a random part averaged
    sparseloco.py     DiLoCo with sparse 2-bit outer gradients; chunked_topk.py its compressor
    median.py, trimmed_mean.py, krum.py, bulyan.py, geomedian.py, centered_clipping.py
                      robust rules against Byzantine towers; nnm.py their pre-aggregation
    compression/      lossy compressed exchanges with error feedback (topk, powersgd, ...)

Old names, each warning (DeprecationWarning) until mgloop 0.2: nodes.py (between_nodes.py).

May import: ground modules, cluster/ (devices, workers, node_layout: the nodes' topology), training/
(variable copies). Never step/ or runs/: the step hands a method its towers' gradients, not
the other way round.
"""

from mgloop import lazy_package

# Everything but the settings part (mgloop.aggregation.exchange_options, plain Python) is
# loaded on first use from registry.py.
__getattr__ = lazy_package.getattr_of(__name__, "mgloop.aggregation.registry")
