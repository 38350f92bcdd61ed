"""Tower tax: step time of N towers against 1 device on the same global batch, side by side.

    python experiments/bench_towers.py --models=mlp,cnn --systems=cpu:1/ring,cpu:4/ring

Every system (a `devices/aggregation` pair) is built in this one process on
logical CPU devices; then repeats are interleaved (system A, B, C, A, B, C, ...)
so that machine drift hits all systems alike. Each repeat times one compiled
loop of `--steps` steps after `--warmup` untimed loops. Reported: median
seconds per step, its median absolute deviation, examples/sec, and the ratio
of each system's median step time to the first system's.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

_FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mlp"], "models to measure")
flags.DEFINE_list("systems", ["cpu:1/ring", "cpu:4/ring"],
                  "devices/aggregation pairs; the first is the baseline of the ratios")
flags.DEFINE_integer("global_batch_size", 128, "global batch, the same for every system")
flags.DEFINE_integer("steps", 50, "steps per timed loop")
flags.DEFINE_integer("warmup", 2, "untimed loops per system before timing")
flags.DEFINE_integer("repeats", 9, "timed loops per system, interleaved")
flags.DEFINE_string("json_out", None, "also write the results here as JSON")


def build(model: str, system: str):
    from mgloop import data, devices, experiment, models
    from mgloop.config import Config
    device_spec, aggregation = system.split("/")
    config = Config(devices=device_spec, aggregation=aggregation, model=model,
                    global_batch_size=_FLAGS.global_batch_size, train_steps=10 ** 9,
                    staging="host",  # tf.data prefetch(2) below, as when these were measured
                    logdir=os.path.join("/tmp", "mgloop-bench")).validated()
    device_set = devices.setup(devices.parse(config.devices))
    dataset = data.load(config.dataset, config.seed)
    trainer = experiment.build_trainer(
        config, device_set, lambda: models.get(model)(dataset.input_shape, dataset.num_classes),
        experiment.default_loss(), dataset.input_shape)
    iterator = iter(dataset.train_batches(config.global_batch_size, config.seed).prefetch(2))
    return trainer, iterator


def time_loop(trainer, iterator, steps) -> float:
    began = time.perf_counter()
    trainer.train_loop(iterator, steps)  # returns once the loop has finished
    return (time.perf_counter() - began) / steps


def measure(model: str, systems: list[str]) -> list[dict]:
    built = {system: build(model, system) for system in systems}
    for system in systems:
        for _ in range(_FLAGS.warmup):
            time_loop(*built[system], _FLAGS.steps)
    times = {system: [] for system in systems}
    for _ in range(_FLAGS.repeats):
        for system in systems:
            times[system].append(time_loop(*built[system], _FLAGS.steps))
    base = float(np.median(times[systems[0]]))
    rows = []
    for system in systems:
        median = float(np.median(times[system]))
        rows.append({"model": model, "system": system, "median_step_s": median,
                     "mad_step_s": float(np.median(np.abs(np.array(times[system]) - median))),
                     "examples_per_sec": _FLAGS.global_batch_size / median,
                     "ratio_to_first": median / base})
    return rows


def main(argv):
    del argv
    from mgloop import devices
    towers = max(devices.parse(s.split("/")[0]).num_towers for s in _FLAGS.systems)
    devices.configure_logical_cpus(towers)
    rows = [row for model in _FLAGS.models for row in measure(model, _FLAGS.systems)]
    print(f"global batch {_FLAGS.global_batch_size}, {_FLAGS.steps} steps/loop, "
          f"{_FLAGS.repeats} interleaved repeats; command: python {' '.join(sys.argv)}")
    print("| model | system | median step (ms) | MAD (ms) | examples/sec | step-time ratio |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {row['system']} | {1e3 * row['median_step_s']:.3f} | "
              f"{1e3 * row['mad_step_s']:.3f} | {row['examples_per_sec']:.0f} | "
              f"{row['ratio_to_first']:.2f} |")
    if _FLAGS.json_out:
        with open(_FLAGS.json_out, "w") as handle:
            json.dump(rows, handle, indent=2)


if __name__ == "__main__":
    app.run(main)
