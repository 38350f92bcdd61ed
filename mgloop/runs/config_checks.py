"""The gate between settings and TensorFlow: `validated(config)`, which `Config.validated()`
(config.py) runs.

A loop over the parts: each package checks its own part (`check(options, context)`, where
`settings.Context` holds what the run is beside it: the devices, the workers, the tower
count, the seed) and returns it with the defaults that depend on the machine resolved (tower
count, global batch, data folder, a model's sizes, the plugins; the loop's part is
runs/loop_checks.py's). Then the combinations of parts, each an explicit call naming the values it
compares; then the folders on disk. A refusal is a `ConfigError` with one line naming the
flag and what would be valid. Nothing here creates a device or a variable; the only side
effect is creating the logdir it has checked (run_dir.py, which also compares a resumed run's
settings with its checkpoints' run; neither with `on_disk` False).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from mgloop import data
from mgloop import models
from mgloop.aggregation import checks as aggregation_checks
from mgloop.aggregation import shard_settings
from mgloop.aggregation import node_settings
from mgloop.aggregation import validation
from mgloop.aggregation.local import async_run
from mgloop.aggregation.local import outer_schedule
from mgloop.aggregation.placement import node_failures
from mgloop.cluster import devices
from mgloop.cluster import checks as cluster_checks
from mgloop.cluster import workers as workers_lib
from mgloop.data import checks as data_checks
from mgloop.errors import ConfigError
from mgloop.models import checks as model_checks
from mgloop.observe import hardware
from mgloop.observe import checks as observe_checks
from mgloop.runs import loop_checks
from mgloop.runs import monitor
from mgloop.runs import run_dir
from mgloop.settings import Context, check_finite
from mgloop.step import checks as step_checks
from mgloop.step import compiled_towers, vectorized_towers
from mgloop.step import options as step_options
from mgloop.step.hooks import attacks
from mgloop.training import checks as optim_checks

if TYPE_CHECKING:
    from mgloop.runs.config import Config

# The parts each package checks, in this order: the exchange first, as it loads the --plugin
# modules, which may register the datasets and models checked after it.
PART_CHECKS = (("exchange", aggregation_checks.check), ("step", step_checks.check),
               ("models", model_checks.check), ("optim", optim_checks.check),
               ("observe", observe_checks.check), ("data", data_checks.check),
               ("loop", loop_checks.check))


def validated(config: Config, on_disk: bool = True) -> Config:
    """Checks every setting of `config`; returns a copy with machine-dependent defaults
    resolved: the parts, then the combinations, then the folders (`on_disk` False: checked
    creatable, none made, no checkpoints compared; the logdir is left as given)."""
    given = config.parts()
    for options in given.values():  # NaN and inf pass every comparison: refused once, here,
        check_finite(options)  # in every part
    # towers per device and timeouts: before the devices are parsed (no fact of the run needed)
    parts = {"cluster": cluster_checks.check(config.cluster, Context())}
    context = _context(config)
    for name, check in PART_CHECKS:
        parts[name] = check(given[name], context)
    _check_combinations(config, context, parts)
    logdir = (run_dir.prepare(config.logdir, config.export_dir) if on_disk
              else run_dir.check_creatable(config.logdir, config.export_dir))
    parts["loop"] = dataclasses.replace(parts["loop"], logdir=logdir)
    resolved = type(config)(**parts)
    if on_disk:
        run_dir.check_resumable(resolved)
    return resolved


def _context(config: Config) -> Context:
    """The facts of the run the parts' checks may use: the devices (one worker's), the
    workers, the towers over all of them, the seed."""
    request = devices.parse(config.devices, config.towers_per_device)
    workers = workers_lib.from_environment()
    num_workers = workers.num_workers if workers else 1
    devices_flag = config.devices + (f" x --towers_per_device={config.towers_per_device}"
                                     if config.towers_per_device > 1 else "")
    if workers is not None:  # towers = workers x devices x K, every shard B / towers
        devices_flag += f" on each of {num_workers} workers"
    return Context(request=request, workers=workers, num_workers=num_workers,
                   num_towers=request.num_towers * num_workers, devices_flag=devices_flag,
                   seed=config.seed, deterministic=config.deterministic)


def _check_combinations(config: Config, context: Context, parts: dict) -> None:
    """What one part's settings mean for another's, each call naming what it compares."""
    exchange, step = parts["exchange"], parts["step"]
    validation.check_batch_norm(exchange, step.batch_norm)
    validation.check_optimizer(exchange, parts["optim"].optimizer)
    shard_settings.check_combinations(exchange, parts["cluster"].towers_per_device,
                                      step.mixed_precision, parts["observe"].histogram_every)
    node_failures.check_schedule(exchange, config.train_steps, context)  # over the run's steps
    outer_schedule.check_run(exchange, config.train_steps)  # Pier's decay within the run
    at_nodes = node_settings.method_at_nodes(exchange, context.num_workers)  # each worker a node
    num_nodes = context.num_workers if context.num_workers > 1 else exchange.nodes
    vectorized_towers.check_method(exchange.aggregation, context.request, at_nodes,
                                   exchange.nodes, exchange.within_node)
    compiled_towers.check_method(step, exchange.aggregation)
    if at_nodes:
        attacks.check_units(step, num_nodes, "nodes (the method is between nodes)",
                            exchange.aggregation, context.num_workers)
    else:
        attacks.check_units(step, context.num_towers, "towers", exchange.aggregation,
                            context.num_workers)
    optim_checks.check_warmup(parts["optim"], config.train_steps)  # after --train_steps
    optim_checks.check_shard_update(parts["optim"], exchange.shard_update)  # muon: whole
    data_part, model_part = parts["data"], parts["models"]
    data.check_model(data_part, model_part.model)  # the dataset feeds the model
    models.check_data(model_part, data_part.dataset, data_part.sequence_length)
    hardware.parse_speeds(parts["observe"].node_speeds, num_nodes)  # one factor per node
    async_run.check_speeds(exchange, parts["observe"].node_speeds, at_nodes)
    if parts["observe"].profile_steps is not None:  # steps A+1 .. B of the run
        monitor.parse_profile_steps(parts["observe"].profile_steps, config.train_steps)
    _check_cluster(step, context.workers)


def _check_cluster(step: step_options.StepOptions, workers: workers_lib.Cluster | None) -> None:
    """What several processes cannot do (yet), refused before anything starts."""
    if workers is None or workers.num_workers == 1:
        return
    where = f"across {workers.num_workers} workers (TF_CONFIG)"  # the method: exchange checks
    if step.batch_norm == "sync":
        raise ConfigError(f"--batch_norm=sync {where}: statistics are synchronised across one "
                          "worker's towers only; use --batch_norm=per_tower")
