"""Shared pieces of the benchmark scripts: plugins, building a system, medians and tables.

A "system" is one mgloop configuration (devices, aggregation, options) built in
one process (experiments/variants.py: several side by side in its process;
experiments/bench_systems.py: one per worker process of experiments/bench.py).
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np


def load_plugins(modules) -> None:
    """Imports each module of `--plugin` (e.g. one registering an aggregation method), in
    order (mgloop.aggregation.load_plugins); one that fails raises PluginError naming it and
    the error (one line)."""
    from mgloop import aggregation
    from mgloop.errors import ConfigError
    try:
        aggregation.load_plugins(list(modules))
    except ConfigError as error:
        raise PluginError(str(error)) from None


class PluginError(ValueError):
    """A --plugin module that cannot be imported; the message is one line."""


def build(model: str, global_batch: int, dataset_object=None, workers=None, device_set=None,
          **settings):
    """(trainer, iterator) for one configuration; settings are Config fields.

    `dataset_object`: an already loaded dataset of `settings["dataset"]` (default: load it).
    Several processes: `workers` (mgloop.cluster.workers.Cluster) and `device_set` (from
    devices.setup with that cluster, its server started): the trainer is wrapped in
    the cross-worker stage, takes worker 0's variables, and reads this worker's
    contiguous part of every global batch, as mgloop.train does.
    """
    from mgloop.runs.config import Config
    config = Config(model=model, global_batch_size=global_batch, train_steps=10 ** 9,
                    logdir=os.path.join("/tmp", "mgloop-bench"), **settings).validated()
    return build_config(config, dataset_object, workers, device_set)[:2]


def build_config(config, dataset_object=None, workers=None, device_set=None,
                 transform=None):
    """(trainer, iterator, dataset) for one validated Config (see `build`); `transform`
    maps the dataset of global batches before the staging's pipeline (e.g. a slow input)."""
    import tensorflow as tf  # noqa: F401  (after the caller configured devices)
    from mgloop import data, models
    from mgloop.cluster import devices
    from mgloop.data import staging
    from mgloop.runs import experiment
    model = config.model
    if device_set is None:
        device_set = devices.setup(devices.parse(config.devices, config.towers_per_device))
    dataset = dataset_object or data.load(config.dataset, config.seed, config.data_dir)
    trainer = experiment.build_trainer(
        config, device_set, lambda: models.get(model)(dataset.input_shape, dataset.num_classes),
        experiment.default_loss(), dataset.input_shape, workers)
    batches = dataset.train_batches(config.global_batch_size, config.seed)
    if workers is not None and workers.num_workers > 1:
        trainer.broadcast_from_chief()
        part = functools.partial(staging.worker_part, workers=workers.num_workers,
                                 index=workers.index)
        batches = batches.map(lambda x, y: (part(x), part(y)))
    if transform is not None:
        batches = transform(batches)
    return trainer, iter(trainer.staging.pipeline(batches)), dataset


def median_and_mad(values) -> tuple[float, float]:
    values = np.asarray(values)
    median = float(np.median(values))
    return median, float(np.median(np.abs(values - median)))


def markdown(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A markdown table; columns are (key, header, format spec)."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "|" + "---|" * len(columns)]
    for row in rows:
        cells = [format(row[k], f) if row.get(k) is not None else "–" for k, _, f in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(header: str, rows: list[dict], columns: list[tuple[str, str, str]],
           json_out: str | None = None) -> None:
    """Prints `header` and the markdown table of `rows`; writes `rows` as JSON if asked."""
    print(header)
    print(markdown(rows, columns))
    if json_out:
        with open(json_out, "w") as handle:
            json.dump(rows, handle, indent=2)
