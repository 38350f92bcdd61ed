"""The gate between settings and TensorFlow: `validated(config)`, which `Config.validated()`
(config.py) runs.

It asks each module to check its own settings (`check_settings(config)`), checks the
combinations, resolves the defaults that depend on the machine (tower count, global
batch, logdir), and raises `ConfigError` with one line naming the flag and what would be
valid. It creates no device and no variable; its only side effect is creating the logdir
it has checked (run_dir.py, which also compares a resumed run's settings with its
checkpoints' run; neither with `on_disk` False). The settings themselves, each with its help line, are config.py's.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from mgloop import data
from mgloop import models
from mgloop import settings
from mgloop.aggregation import exchange_options
from mgloop.aggregation import node_failures
from mgloop.aggregation import nodes as node_level
from mgloop.aggregation import validation as exchange_checks
from mgloop.cluster import devices
from mgloop.cluster import options as cluster_options
from mgloop.cluster import workers as cluster
from mgloop.data import staging
from mgloop.errors import ConfigError
from mgloop.observe import hardware
from mgloop.observe import link_model
from mgloop.runs import checkpoint
from mgloop.runs import controller
from mgloop.runs import monitor
from mgloop.runs import run_dir
from mgloop.settings import check_finite
from mgloop.settings import in_range as _check_range
from mgloop.spec import optim
from mgloop.step import accumulation
from mgloop.step import compiled_towers, vectorized_towers
from mgloop.step import ordered_sum
from mgloop.step import precision
from mgloop.step import sufficient_factors
from mgloop.step import sync_batch_norm
from mgloop.step.hooks import attacks as byzantine

if TYPE_CHECKING:
    from mgloop.runs.config import Config

# numpy's seed (keras.utils.set_random_seed seeds numpy, Python and TensorFlow) is 32 bits.
MAX_SEED = 2**32 - 1


def validated(config: Config, on_disk: bool = True) -> Config:
    """Checks every setting of `config`; returns a copy with machine-dependent defaults
    resolved. Each module checks its own settings, in this order; then the combinations
    that involve the aggregation method and several workers; then the folders on disk
    (`on_disk` False: checked creatable, none made, no checkpoints compared; the logdir
    is left as given)."""
    for part in dataclasses.fields(config):  # NaN and inf pass every comparison: refused
        check_finite(getattr(config, part.name))  # once, here, in every part
    # towers per device and timeouts: before the devices are parsed (no fact of the run needed)
    cluster_part = cluster_options.check(config.cluster, settings.Context())
    request = devices.parse(config.devices, config.towers_per_device)
    workers = cluster.from_environment()
    num_workers = workers.num_workers if workers else 1
    towers = request.num_towers * num_workers
    devices_flag = config.devices + (f" x --towers_per_device={config.towers_per_device}"
                                     if config.towers_per_device > 1 else "")
    if workers is not None:  # towers = workers x devices x K, every shard B / towers
        devices_flag += f" on each of {num_workers} workers"
    context = settings.Context(request=request, workers=workers, num_workers=num_workers,
                               num_towers=towers, devices_flag=devices_flag, seed=config.seed,
                               deterministic=config.deterministic)
    # --plugin modules loaded, then the method, its options and what combines with it
    exchange = exchange_options.check(config.exchange, context)
    exchange_checks.check_batch_norm(config.exchange, config.batch_norm)
    exchange_checks.check_optimizer(config.exchange, config.optimizer)
    # --node_failures: the nodes' schedule over the run's steps
    node_failures.check_schedule(config.exchange, config.train_steps, context)
    vectorized_towers.check_settings(config, request, workers)
    compiled_towers.check_settings(config)
    if node_level.method_at_nodes(config.exchange, num_workers):  # each worker a node, if several
        byzantine.check_settings(config, num_workers if num_workers > 1 else config.nodes,
                                 "nodes (the method is between nodes)")
    else:
        byzantine.check_settings(config, towers)
    for module in (models, controller, optim, staging, accumulation, precision,
                   sync_batch_norm, ordered_sum, sufficient_factors, checkpoint, monitor,
                   link_model):
        module.check_settings(config)  # the settings the module uses
    _check_range("seed", config.seed, low=0, high=MAX_SEED)
    global_batch, data_dir = data.check_settings(config, towers, devices_flag)
    data.check_partition(config)
    hardware.check_settings(config, num_workers if num_workers > 1 else config.nodes)
    _check_cluster(config, workers)
    logdir = (run_dir.prepare(config.logdir, config.export_dir) if on_disk
              else run_dir.check_creatable(config.logdir, config.export_dir))
    resolved = dataclasses.replace(
        config, cluster=cluster_part, exchange=exchange, logdir=logdir, data_dir=data_dir,
        global_batch_size=global_batch, batch_size_per_tower=global_batch // towers,
        sequence_length=data.sequence_length_of(config), **models.resolved_settings(config))
    if on_disk:
        run_dir.check_resumable(resolved)
    return resolved


def _check_cluster(config: Config, workers: cluster.Cluster | None) -> None:
    """What several processes cannot do (yet), refused before anything starts."""
    if workers is None or workers.num_workers == 1:
        return
    where = f"across {workers.num_workers} workers (TF_CONFIG)"  # the method: exchange checks
    if config.batch_norm == "sync":
        raise ConfigError(f"--batch_norm=sync {where}: statistics are synchronised across one "
                          "worker's towers only; use --batch_norm=per_tower")
