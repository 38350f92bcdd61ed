"""Shared pieces of the benchmark scripts: build systems in one process, time them interleaved.

A "system" is one mgloop configuration (devices, aggregation, options) built in
this process on logical CPU devices. Repeats are interleaved (A, B, C, A, B, C,
...) so that machine drift hits every system alike; each repeat times one
compiled loop of `steps` steps after untimed warm-up loops.
"""

from __future__ import annotations

import functools
import json
import os
import time

import numpy as np


def define_timing_flags(unit: str, steps: int, warmup: int, repeats: int) -> None:
    """--steps, --warmup and --repeats (the arguments of `interleaved`) and --json_out,
    each `unit` (system, mode, variant) being one of the systems timed."""
    from absl import flags
    flags.DEFINE_integer("steps", steps, "steps per timed loop")
    flags.DEFINE_integer("warmup", warmup, f"untimed loops per {unit} before timing")
    flags.DEFINE_integer("repeats", repeats, f"timed loops per {unit}, interleaved")
    flags.DEFINE_string("json_out", None, "also write the results here as JSON")


def build(model: str, global_batch: int, dataset_object=None, workers=None, device_set=None,
          **settings):
    """(trainer, iterator) for one configuration; settings are Config fields.

    `dataset_object`: an already loaded dataset of `settings["dataset"]` (default: load it).
    Several processes: `workers` (mgloop.cluster.Cluster) and `device_set` (from
    devices.setup with that cluster, its server started): the trainer is wrapped in
    the cross-worker stage, takes worker 0's variables, and reads this worker's
    contiguous part of every global batch, as mgloop.train does.
    """
    import tensorflow as tf  # noqa: F401  (after the caller configured devices)
    from mgloop import data, devices, experiment, models, staging
    from mgloop.config import Config
    config = Config(model=model, global_batch_size=global_batch, train_steps=10 ** 9,
                    logdir=os.path.join("/tmp", "mgloop-bench"), **settings).validated()
    if device_set is None:
        device_set = devices.setup(devices.parse(config.devices))
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
    return trainer, iter(trainer.staging.pipeline(batches))


def time_loop(trainer, iterator, steps: int) -> float:
    """Seconds per step of one compiled loop of `steps` steps."""
    began = time.perf_counter()
    trainer.train_loop(iterator, steps)  # returns once the loop has finished
    return (time.perf_counter() - began) / steps


def interleaved(systems: dict, steps: int, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Per-step times of every system, `repeats` interleaved loops each after `warmup`."""
    for name, (trainer, iterator) in systems.items():
        for _ in range(warmup):
            time_loop(trainer, iterator, steps)
    times = {name: [] for name in systems}
    for _ in range(repeats):
        for name, (trainer, iterator) in systems.items():
            times[name].append(time_loop(trainer, iterator, steps))
    return times


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


def speed(times, global_batch: int, base: float) -> dict:
    """Per-step `times` (seconds) as the median examples/sec with its MAD (propagated from
    the step time's), the median step in ms, and the step-time ratio to `base` seconds."""
    median, mad = median_and_mad(times)
    return {"examples_per_sec": global_batch / median,
            "mad_examples_per_sec": global_batch * mad / median ** 2,
            "step_ms": 1e3 * median, "ratio": median / base}


def report(header: str, rows: list[dict], columns: list[tuple[str, str, str]],
           json_out: str | None = None) -> None:
    """Prints `header` and the markdown table of `rows`; writes `rows` as JSON if asked."""
    print(header)
    print(markdown(rows, columns))
    if json_out:
        with open(json_out, "w") as handle:
            json.dump(rows, handle, indent=2)
