"""The gate between settings and TensorFlow: `validated(config)`, which `Config.validated()`
(config.py) runs.

It asks each package to check its own part of the settings (`check(options, context)`,
settings.Context: what the run is beside them) and each remaining module its own
(`check_settings(config)`), checks the combinations, resolves the defaults that depend on
the machine (tower count, global batch, logdir), and raises `ConfigError` with one line
naming the flag and what would be valid. It creates no device and no variable; its only
side effect is creating the logdir it has checked (run_dir.py, which also compares a
resumed run's settings with its checkpoints' run; neither with `on_disk` False). The
settings themselves, each with its help line, are config.py's.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from mgloop import aggregation
from mgloop import data
from mgloop import models
from mgloop.aggregation import node_failures
from mgloop.aggregation import nodes as node_level
from mgloop.cluster import devices
from mgloop.cluster import workers as cluster
from mgloop.data import options as data_options
from mgloop.errors import ConfigError
from mgloop.models import options as model_options
from mgloop.observe import hardware
from mgloop.observe import options as observe_options
from mgloop.runs import checkpoint
from mgloop.runs import controller
from mgloop.runs import monitor
from mgloop.runs import run_dir
from mgloop.settings import Context, check_finite
from mgloop.settings import in_range as _check_range
from mgloop.spec import options as optim_options
from mgloop.step import compiled_towers, vectorized_towers
from mgloop.step import options as step_options
from mgloop.step.hooks import attacks as byzantine

if TYPE_CHECKING:
    from mgloop.runs.config import Config

MIN_PEER_TIMEOUT = 5.0  # seconds: the shortest --collective_timeout (see _check_cluster)
# numpy's seed (keras.utils.set_random_seed seeds numpy, Python and TensorFlow) is 32 bits.
MAX_SEED = 2**32 - 1


def validated(config: Config, on_disk: bool = True) -> Config:
    """Checks every setting of `config`; returns a copy with machine-dependent defaults
    resolved. Each module checks its own settings, in this order; then the combinations
    that involve the aggregation method and several workers; then the folders on disk
    (`on_disk` False: checked creatable, none made, no checkpoints compared; the logdir
    is left as given)."""
    check_finite(config)  # NaN and inf pass every comparison: refused once, here
    _check_range("towers_per_device", config.towers_per_device, low=1)
    request = devices.parse(config.devices, config.towers_per_device)
    workers = cluster.from_environment()
    num_workers = workers.num_workers if workers else 1
    towers = request.num_towers * num_workers
    devices_flag = config.devices + (f" x --towers_per_device={config.towers_per_device}"
                                     if config.towers_per_device > 1 else "")
    if workers is not None:  # towers = workers x devices x K, every shard B / towers
        devices_flag += f" on each of {num_workers} workers"
    context = Context(request=request, workers=workers, num_workers=num_workers,
                      num_towers=towers, devices_flag=devices_flag, seed=config.seed,
                      deterministic=config.deterministic)
    # --plugin modules loaded, then the method, its options and what combines with it
    aggregation.check_settings(config, request, workers)
    node_failures.check_settings(config, workers, request)  # --node_failures: the nodes' schedule
    step_options.check(config.step, context)
    at_nodes = node_level.method_at_nodes(config, num_workers)  # each worker is a node, if several
    num_nodes = num_workers if num_workers > 1 else config.nodes
    vectorized_towers.check_method(config.aggregation, request, at_nodes, config.nodes,
                                   config.within_node)
    compiled_towers.check_method(config.step, config.aggregation)
    if at_nodes:
        byzantine.check_units(config.step, num_nodes, "nodes (the method is between nodes)",
                              config.aggregation, num_workers)
    else:
        byzantine.check_units(config.step, towers, "towers", config.aggregation, num_workers)
    model_part = model_options.check(config.models, context)
    controller.check_settings(config)
    optim_options.check(config.optim, context)
    optim_options.check_warmup(config.optim, config.train_steps)  # after --train_steps
    for module in (checkpoint, monitor):
        module.check_settings(config)  # the settings the module uses
    observe_options.check(config.observe, context)
    _check_range("seed", config.seed, low=0, high=MAX_SEED)
    data_part = data_options.check(config.data, context)
    data.check_model(data_part, model_part.model)  # the dataset feeds the model
    models.check_data(model_part, data_part.dataset, data_part.sequence_length)
    hardware.parse_speeds(config.node_speeds, num_nodes)  # one factor per node
    _check_cluster(config, workers)
    logdir = (run_dir.prepare(config.logdir, config.export_dir) if on_disk
              else run_dir.check_creatable(config.logdir, config.export_dir))
    resolved = dataclasses.replace(
        config, data=data_part, models=model_part, logdir=logdir,
        plugins=aggregation.plugins.plugin_list(config.plugins))
    if on_disk:
        run_dir.check_resumable(resolved)
    return resolved


def _check_cluster(config: Config, workers: cluster.Cluster | None) -> None:
    """What several processes cannot do (yet), refused before anything starts."""
    _check_range("startup_timeout", config.startup_timeout, low=0.0, low_open=True)
    # A peer is declared lost after this many seconds without an answer to the health checks,
    # made every max(0.5, timeout / 4) s (peer_health.py): under 5 s, four checks in a row of
    # a loaded but healthy peer could miss, so shorter timeouts are refused.
    _check_range("collective_timeout", config.collective_timeout, low=MIN_PEER_TIMEOUT)
    if workers is None or workers.num_workers == 1:
        return
    where = f"across {workers.num_workers} workers (TF_CONFIG)"  # the method: check_settings
    if config.batch_norm == "sync":
        raise ConfigError(f"--batch_norm=sync {where}: statistics are synchronised across one "
                          "worker's towers only; use --batch_norm=per_tower")
