"""Which node settings apply: --nodes, --method_at, --within_node, checked before
anything is built (placement/between_nodes.py builds the nodes; validation.py calls this);
and `method_at_nodes`, whether the method runs between nodes, which the checks and
between_nodes.py ask."""

from __future__ import annotations

from mgloop import aggregation
from mgloop.aggregation.base import REPLICATED
from mgloop.aggregation.dense.hierarchical import divisors
from mgloop.aggregation.exchange_options import DIRECT, METHOD_AT, ExchangeOptions
from mgloop.cluster.devices import DeviceRequest
from mgloop.errors import ConfigError


def check_nodes(options: ExchangeOptions, context) -> DeviceRequest:
    """Refuses --nodes, --method_at, --within_node that do not apply (one line each), on
    the towers of `context.request` (settings.Context); returns the DeviceRequest the
    method itself sees: one entry per node at the nodes."""
    nodes, method_at, within = options.nodes, options.method_at, options.within_node
    request = context.request
    if method_at not in METHOD_AT:
        raise ConfigError(f"--method_at={method_at!r} is not one of: {', '.join(METHOD_AT)}")
    if nodes < 1:
        raise ConfigError(f"--nodes={nodes} is out of range: must be >= 1")
    num_workers = context.num_workers
    if num_workers > 1:
        if nodes != 1:
            raise ConfigError(f"--nodes={nodes} across {num_workers} workers (TF_CONFIG): "
                              "each worker is a node; leave --nodes at 1")
    elif request.num_towers % nodes:
        raise ConfigError(f"--nodes={nodes} does not divide the {request.num_towers} towers "
                          f"into equal nodes; use one of: "
                          f"{', '.join(map(str, divisors(request.num_towers)))}")
    if method_at == "nodes" and nodes == 1 and num_workers == 1:
        raise ConfigError("--method_at=nodes with --nodes=1: one node has no link between "
                          "nodes; give --nodes=N > 1 or --method_at=towers")
    at_nodes = method_at_nodes(options, num_workers)
    if within != DIRECT:
        if not at_nodes:
            raise ConfigError(f"--within_node={within} applies only with the method between "
                              f"nodes (--nodes=N > 1, or several workers); leave it at "
                              f"{DIRECT}")
        exact = [n for n in aggregation.names() if _exact_stage(aggregation.get(n))]
        if within not in exact:
            raise ConfigError(f"--within_node={within} is not an exact replicated method; "
                              f"use {DIRECT} (the default) or one of: {', '.join(exact)}")
    if not at_nodes:
        return request
    method = aggregation.get(options.aggregation)
    where = (f"between --nodes={nodes} nodes" if num_workers == 1
             else f"between {num_workers} workers (nodes)")
    if method.capabilities.single_loss:
        raise ConfigError(f"--aggregation={options.aggregation} {where}: it computes one loss "
                          "over every tower, none per node; use --method_at=towers or a "
                          "tower-loop method")
    if num_workers > 1:
        if not method.capabilities.runs_between_processes:
            raise ConfigError(f"--aggregation={options.aggregation} {where}: it moves values "
                              "only between its own towers (it does not declare "
                              "runs_between_processes), which would exchange nothing between "
                              "the workers; use --method_at=towers or one of: "
                              + ", ".join(n for n in aggregation.names() if aggregation.get(
                                  n).capabilities.runs_between_processes))
        if not method.capabilities.exchanges:
            raise ConfigError(f"--aggregation={options.aggregation} {where}: its replicas "
                              "exchange nothing, so there is nothing to send between nodes; "
                              "use a method that exchanges gradients")
        return DeviceRequest(request.kind, tuple(range(num_workers)))
    per_node, k = request.num_towers // nodes, request.towers_per_device
    return DeviceRequest(request.kind, tuple(request.indices[n * per_node // k]
                                             for n in range(nodes)))


def _exact_stage(method) -> bool:
    caps = method.capabilities
    return (caps.exact and caps.exchanges and caps.layout == REPLICATED
            and not caps.single_loss and not caps.copies_differ)


def method_at_nodes(options: ExchangeOptions, num_workers: int = 1) -> bool:
    """Whether the exchange `options` put the method between nodes: N > 1 simulated nodes
    in one process, or several workers (each a node) with --method_at=nodes, or with auto
    for a method that is not exact (an exact one's local stage inside each worker and the
    one collective between them, cross_worker.py, already sum within and then between
    nodes)."""
    if num_workers <= 1:
        return options.nodes > 1 and options.method_at in ("auto", "nodes")
    if options.method_at == "auto":
        caps = aggregation.get(options.aggregation).capabilities
        return (not caps.exact and caps.exchanges and not caps.single_loss
                and caps.runs_between_processes)
    return options.method_at == "nodes"
