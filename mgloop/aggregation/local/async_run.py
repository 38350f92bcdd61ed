"""async_diloco in a run: --node_speeds handed to the method (`with_node_speeds`) and
refused at the towers (`check_speeds`); its staleness as summary.json's "async_staleness"
and TensorBoard scalars. The schedule itself is async_clock.py's, which async_diloco.py
imports; this glue imports async_diloco.py, so it lives apart from the schedule."""

from __future__ import annotations

from mgloop.aggregation.local.async_diloco import AsyncDiLoCo
from mgloop.errors import ConfigError


def with_node_speeds(make, text: str | None):
    """`make` (registry.make) that gives async_diloco the --node_speeds `text` (checked
    before: observe/hardware.parse_speeds, `check_speeds`); other methods as they were."""
    speeds = tuple(float(part) for part in text.split(",")) if text else None

    def made(spec, devices, transport_dtype="float32", **construction):
        if speeds and _is_async(spec):
            construction["node_speeds"] = speeds
        return make(spec, devices, transport_dtype, **construction)
    return made


def check_speeds(exchange, node_speeds: str | None, at_nodes: bool) -> None:
    """Refuses (one line) --node_speeds for async_diloco at the towers (a speed per node)."""
    if node_speeds and not at_nodes and _is_async(exchange.aggregation):
        raise ConfigError(f"--aggregation={exchange.aggregation} with --node_speeds="
                          f"{node_speeds} needs the method at the nodes (--nodes=N, one "
                          "speed per node), not at the towers")


def _is_async(spec: str) -> bool:
    from mgloop import aggregation  # the registry loads the methods
    return issubclass(aggregation.get(spec), AsyncDiLoCo)


def staleness_of(level) -> dict | None:
    """async_diloco's `staleness()` in a run's aggregation `level` (the method, or a NodeLevel
    around it), as summary.json's "async_staleness"; None for any other method."""
    method = getattr(level, "inner", level)
    if not isinstance(method, AsyncDiLoCo) or method.num_towers == 1:
        return None
    return method.staleness()


def scalars(level) -> dict[str, float]:
    """The staleness as TensorBoard scalars (async/...): merges, mean and maximum."""
    stats = staleness_of(level)
    if not stats:
        return {}
    merges = stats["merges"]
    return {"async/merges": float(merges), "async/staleness_max": float(stats["staleness_max"]),
            "async/staleness_mean": stats["staleness_sum"] / merges if merges else 0.0}

