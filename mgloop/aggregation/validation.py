"""Which settings combine with a method, decided from its declared capabilities.

`check_method(options, context)` (ExchangeOptions and settings.Context; called by
checks.py's check before any device or variable exists) loads `--plugin` modules
(plugins.py), parses `--aggregation` (options.py), checks the settings that apply to
every method (`grad_reduce`, `transport_dtype`, `pack_bytes`) against what the method
declares (its `capabilities` record, capabilities.py; never its name), then the method's own
`check(request, options)`. `check_batch_norm` and `check_optimizer` check the method
with another part's setting (runs/config_checks.py calls them). Every refusal is one
ConfigError line naming the flag and what would be valid.

    --transport_dtype != float32   needs an exchange, a REPLICATED layout (shared variables
                                   are read at float32 by the towers) and
                                   `compressed_transport`
    --pack_bytes > 0               needs an exchange and `summable` or `buckets_payloads`
                                   (a compressor's gathered payloads); a value other than the
                                   field's default (an explicit choice) is refused otherwise,
                                   the default is simply not applied (the step packs only
                                   summable methods)
    --batch_norm=sync              needs per-tower losses (not `single_loss`) and an
                                   exchange (--diagnostics with a single-loss method writes
                                   nothing per tower: assemble.build logs it)
    `applies_momentum(options)`    needs --optimizer=sgd (DGC's momentum correction)
    `needs_optimizer`              that --optimizer (des_loc: adam, whose m and v it averages)
    several workers, at towers     need `across_workers` (at the nodes every method runs
                                   between the workers: between_nodes.py, peers.py)
    tower devices                  must be of a kind in `device_kinds`
    --deterministic                needs `reproducible(options)` (no clock read)
"""

from __future__ import annotations

from mgloop import aggregation
from mgloop.aggregation import node_settings
from mgloop.aggregation.base import SHARED, Aggregation, Options
from mgloop.aggregation.placement.gather_at_root import TowerCountError
from mgloop.aggregation.plugins import load_plugins
from mgloop.errors import ConfigError

from mgloop.aggregation.exchange_options import (DEFAULT_BUCKET_BYTES, GRAD_REDUCE,
                                                 TRANSPORT_DTYPES, ExchangeOptions)


def check_method(options: ExchangeOptions, context) -> tuple[type[Aggregation], Options]:
    """Refuses the aggregation settings that do not combine, on the towers of
    `context.request` and the workers of `context` (settings.Context); returns (the
    method's class, its options)."""
    load_plugins(options.plugins)
    method, method_options = aggregation.parse(options.aggregation)
    _choice("grad_reduce", options.grad_reduce, GRAD_REDUCE)
    _choice("transport_dtype", options.transport_dtype, TRANSPORT_DTYPES)
    if options.pack_bytes < 0:
        raise ConfigError(f"--pack_bytes={options.pack_bytes} is out of range: must be >= 0")
    mode = f"--aggregation={options.aggregation}"
    request = context.request
    if request.kind not in method.capabilities.device_kinds:
        kinds = " or ".join(k.upper() for k in method.capabilities.device_kinds)
        raise ConfigError(f"{mode} needs {kinds} towers (--devices={request.kind}... gives "
                          f"{request.kind.upper()} towers); methods that run there: "
                          f"{_names(lambda m: request.kind in m.device_kinds)}")
    _check_transport(options.transport_dtype, method, mode)
    _check_packing(options.pack_bytes, method, mode)
    if context.deterministic and not method.reproducible(method_options):
        raise ConfigError(f"{mode} reads a clock, which --deterministic forbids; use "
                          "--nodeterministic or options that draw from a seed")
    participants = node_settings.check_nodes(options, context)  # one per node, or tower
    try:
        method.check(participants, method_options)
    except ConfigError as error:
        if participants is request:
            raise
        several = context.num_workers > 1
        count = participants.num_towers
        if isinstance(error, TowerCountError):  # said of the nodes, with what would run
            raise ConfigError(error.at_nodes(
                f"{count} workers (TF_CONFIG) give {count} nodes" if several
                else f"--nodes={count} gives {count} nodes",
                None if several else request.num_towers)) from None
        where = (f"the {count} workers (each worker is a node)" if several
                 else f"the {count} nodes of --nodes")
        raise ConfigError(f"{error} (at --method_at=nodes the method's towers are "
                          f"{where})") from None
    workers = context.num_workers
    if (workers > 1 and not method.capabilities.across_workers
            and not node_settings.method_at_nodes(options, workers)):
        where = f"across {workers} workers (TF_CONFIG)"
        if method.capabilities.single_loss:
            reason = "the single-loss baseline runs in one process; use a tower-loop mode"
        elif not method.capabilities.exchanges:
            reason = ("its replicas exchange nothing, so there is nothing to sum between "
                      "workers; use a mode that averages gradients")
        else:
            reason = ("at --method_at=towers the workers add the method's dense local "
                      "sums, which it cannot give; use --method_at=nodes (each worker a "
                      "node: the default for it) or one of: "
                      + _names(lambda m: m.across_workers))
        raise ConfigError(f"{mode} {where}: {reason}")
    return method, method_options


def check_batch_norm(options: ExchangeOptions, batch_norm: str) -> None:
    """--batch_norm=sync needs per-tower losses and an exchange (the method's)."""
    method = aggregation.get(options.aggregation)
    caps = method.capabilities
    if batch_norm == "sync" and (caps.single_loss or not caps.exchanges):
        reason = ("re-creates multi_gpu_model, whose batch norm is per tower" if
                  caps.single_loss else "trains each replica alone on its own shard")
        raise ConfigError(f"--batch_norm=sync with --aggregation={options.aggregation}, which "
                          f"{reason}; use --batch_norm=per_tower or a mode that exchanges "
                          "gradients per tower")


def check_optimizer(options: ExchangeOptions, optimizer) -> None:
    """A method that applies momentum itself needs --optimizer=sgd, one that `needs_optimizer`
    that one (`optimizer`: its name, or a Keras optimizer a user gives, not checked here)."""
    method, method_options = aggregation.parse(options.aggregation)
    needed = method.capabilities.needs_optimizer
    if needed and isinstance(optimizer, str) and optimizer != needed:
        raise ConfigError(f"--aggregation={options.aggregation} averages the moments of "
                          f"--optimizer={needed}, which --optimizer={optimizer} does not "
                          f"keep; use --optimizer={needed}")
    if (method.applies_momentum(method_options) and isinstance(optimizer, str)
            and optimizer != "sgd"):
        raise ConfigError(f"--aggregation={options.aggregation} applies momentum itself, so "
                          f"--optimizer={optimizer} would apply a second one on top; use "
                          "--optimizer=sgd (or the method's momentum=0)")


def _check_transport(dtype: str, method: type[Aggregation], mode: str) -> None:
    caps = method.capabilities
    if dtype == "float32":
        return
    if not caps.exchanges:
        raise ConfigError(f"--transport_dtype={dtype} means nothing with {mode}, which "
                          "exchanges no gradients; leave it at float32")
    compressing = _names(lambda m: m.exchanges and m.layout != SHARED
                         and m.compressed_transport)
    if caps.layout == SHARED:
        raise ConfigError(f"--transport_dtype={dtype} means nothing with {mode} (shared "
                          "variables: towers read the float32 variables themselves); use a "
                          f"replicated mode ({compressing}) or leave it at float32")
    if not caps.compressed_transport:
        raise ConfigError(f"--transport_dtype={dtype} with {mode}: its kernel sums in the "
                          "dtype it is given, so the sum could not stay in float32; use "
                          f"{compressing} for compressed transport")


def _check_packing(pack_bytes: int, method: type[Aggregation], mode: str) -> None:
    caps = method.capabilities
    if not pack_bytes or pack_bytes == DEFAULT_BUCKET_BYTES:  # the default: simply not applied
        return
    if not caps.exchanges:
        raise ConfigError(f"--pack_bytes={pack_bytes} means nothing with {mode}, which "
                          "exchanges no gradients; leave it at 0")
    if not caps.summable and not caps.buckets_payloads:
        raise ConfigError(f"--pack_bytes={pack_bytes} with {mode}: "
                          f"{caps.unsummable_reason}; use a summable method ("
                          f"{_names(lambda m: m.summable and m.exchanges)}) or "
                          "--pack_bytes=0")


def _names(keep) -> str:
    """The methods whose capabilities record `keep` accepts, by name."""
    return ", ".join(n for n in aggregation.names() if keep(aggregation.get(n).capabilities))


def _choice(flag: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"--{flag}={value!r} is not one of: {', '.join(sorted(choices))}")
