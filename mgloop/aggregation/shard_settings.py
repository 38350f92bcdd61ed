"""What --shard_update combines with, refused in one line each before anything is built.

    the method            one that splits its all-reduce (shard_exchange.ShardsUpdate:
                          ring, collective, hierarchical), with options and towers it can
                          shard on (its `sharding_refusal`: ring with one ring, shards=1)
    nodes                 the method at the towers (the chunks are the towers' own):
                          --nodes=1 in one process, --method_at=towers (auto's choice for
                          these exact methods) across workers
    collective            at most 10 towers (TensorFlow's all-to-all from 11 members on)
    towers per device     one (a copy per tower)
    --mixed_precision     not mixed_float16 (its loss scale is optimizer state kept whole)
    --histogram_every     0 (no copy holds the whole mean gradient to draw)

The optimizer is checked when the template exists (step/sharded_update.check_optimizer).
"""

from __future__ import annotations

from mgloop.errors import ConfigError

FLAG = "--shard_update"


def check(options, context) -> None:
    """The method and the run's towers, nodes and workers (`context`: settings.Context)."""
    if not options.shard_update:
        return
    from mgloop import aggregation
    from mgloop.aggregation.placement.shard_exchange import ShardsUpdate
    method, method_options = aggregation.parse(options.aggregation)
    mode = f"--aggregation={options.aggregation}"
    if not issubclass(method, ShardsUpdate):
        names = ", ".join(n for n in aggregation.names()
                          if issubclass(aggregation.get(n), ShardsUpdate))
        raise ConfigError(f"{FLAG} with {mode}: the method does not split its all-reduce into "
                          f"a reduce-scatter and an all-gather; use one of: {names}")
    refusal = method.sharding_refusal(method_options, context.request.num_towers)  # one worker's
    if refusal:
        raise ConfigError(f"{FLAG} with {mode}: {refusal}")
    from mgloop.aggregation.node_settings import method_at_nodes
    if method_at_nodes(options, context.num_workers):
        where = (f"across {context.num_workers} workers (TF_CONFIG) with "
                 f"--method_at={options.method_at}" if context.num_workers > 1
                 else f"with --nodes={options.nodes}")
        raise ConfigError(f"{FLAG} {where}: the update is sharded among each process's towers, "
                          "with the method at the towers; use --nodes=1 (--method_at=towers "
                          f"across workers), or leave out {FLAG}")


def check_combinations(options, towers_per_device: int, mixed_precision: str,
                       histogram_every: int) -> None:
    """The other parts' settings a sharded update cannot take."""
    if not options.shard_update:
        return
    if towers_per_device > 1:
        raise ConfigError(f"{FLAG} with --towers_per_device={towers_per_device}: the update "
                          "is sharded among one copy per tower; use --towers_per_device=1")
    if mixed_precision == "mixed_float16":
        raise ConfigError(f"{FLAG} with --mixed_precision=mixed_float16: its loss scale is "
                          "state of the whole optimizer; use mixed_bfloat16 (no loss scale) "
                          f"or leave out {FLAG}")
    if histogram_every:
        raise ConfigError(f"{FLAG} with --histogram_every={histogram_every}: no copy holds "
                          "the whole mean gradient to draw; use --histogram_every=0")
