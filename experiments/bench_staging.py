"""Input staging against a slow input: none | host | device, side by side.

    python experiments/bench_staging.py --model=cnn --devices=cpu:2

The input is the synthetic training stream made deliberately slow: every
global batch waits a fixed delay on the host (a `tf.py_function` that sleeps,
like a read or a decode that does not use these cores). By default the delay
is calibrated so that producing a batch takes as long as a training step:
t_input = t_compute, where staging matters most.

In this one process, on the same devices, the script builds three trainers
that differ only in `--staging`, then times, in interleaved repeats (A, B,
C, ..., A, B, C, ...) so that machine drift hits all alike:

    compute  a fourth trainer, with `device` staging, on one constant batch, so
             input costs next to nothing and is hidden: t_compute
    input    the slow pipeline alone, as `host` and `device` read it (tf.data's own
             optimizations, prefetch K), batches pulled in a compiled loop: t_input,
             the rate at which the host can make batches
    none, host, device   the three trainers on the slow input

Reported: median seconds per step over the repeats, examples/sec, the ratio
to the ideal 1 / max(t_input, t_compute) (1.0 = input fully hidden), the ratio
to `none`, and the input wait per step that mgloop itself measured.
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
flags.DEFINE_string("model", "cnn", "model to train")
flags.DEFINE_string("devices", "cpu:2", "tower devices, the same for every mode")
flags.DEFINE_string("aggregation", "reduce_broadcast", "aggregation, the same for every mode")
flags.DEFINE_integer("global_batch_size", 128, "global batch")
flags.DEFINE_integer("staging_depth", 2, "K of host and device staging")
flags.DEFINE_float("delay_ms", None, "per-batch input delay; default: t_compute minus the "
                   "input's own time per batch, so that t_input = t_compute")
flags.DEFINE_integer("steps", 30, "steps per timed loop")
flags.DEFINE_integer("warmup", 2, "untimed loops per system before timing")
flags.DEFINE_integer("repeats", 7, "timed loops per system, interleaved")
flags.DEFINE_string("json_out", None, "also write the results here as JSON")

MODES = ("none", "host", "device")


def build(mode: str):
    from mgloop import data, devices, experiment, models
    from mgloop.config import Config
    config = Config(devices=_FLAGS.devices, aggregation=_FLAGS.aggregation, model=_FLAGS.model,
                    global_batch_size=_FLAGS.global_batch_size, train_steps=10 ** 9,
                    staging=mode, staging_depth=_FLAGS.staging_depth,
                    logdir=os.path.join("/tmp", "mgloop-bench")).validated()
    device_set = devices.setup(devices.parse(config.devices))
    dataset = data.load(config.dataset, config.seed)
    trainer = experiment.build_trainer(
        config, device_set,
        lambda: models.get(config.model)(dataset.input_shape, dataset.num_classes),
        experiment.default_loss(), dataset.input_shape)
    return trainer, dataset


def slow_stream(dataset, delay: float):
    """The training stream with `delay` seconds of host-side waiting per global batch."""
    import tensorflow as tf

    def wait(x):
        time.sleep(delay)
        return x
    batches = dataset.train_batches(_FLAGS.global_batch_size, seed=0)
    return batches.map(
        lambda x, y: (tf.ensure_shape(tf.py_function(wait, [x], tf.float32), x.shape), y))


def make_input_timer():
    import tensorflow as tf

    @tf.function
    def pull(iterator, steps):
        total = tf.constant(0.0)
        for _ in tf.range(steps):
            x, _ = next(iterator)
            total += x[0, 0, 0, 0]
        return total

    def time_input(iterator, steps):
        began = time.perf_counter()
        float(pull(iterator, tf.constant(steps)))
        return (time.perf_counter() - began) / steps, 0.0
    return time_input


def time_training(trainer, iterator, steps):
    began = time.perf_counter()
    result = trainer.train_loop(iterator, steps)
    seconds = time.perf_counter() - began
    assert result.steps == steps
    return seconds / steps, result.input_wait / steps


def main(argv):
    del argv
    from mgloop import devices
    devices.configure_logical_cpus(devices.parse(_FLAGS.devices).num_towers)
    import tensorflow as tf

    built = {mode: build(mode) for mode in MODES}
    trainers = {mode: trainer for mode, (trainer, _) in built.items()}
    dataset = built["none"][1]
    # Its own trainer, so that the device trainer keeps its staged slow batches.
    compute_trainer, _ = build("device")
    batch = next(iter(dataset.train_batches(_FLAGS.global_batch_size, seed=0)))
    constant = iter(tf.data.Dataset.from_tensors(batch).repeat())
    time_input = make_input_timer()

    def compute(steps):
        return time_training(compute_trainer, constant, steps)

    delay = _FLAGS.delay_ms / 1e3 if _FLAGS.delay_ms is not None else None
    if delay is None:  # calibrate: t_input = t_compute
        free = iter(trainers["host"].staging.pipeline(slow_stream(dataset, 0.0)))
        for _ in range(_FLAGS.warmup):
            compute(_FLAGS.steps), time_input(free, _FLAGS.steps)
        t_compute = np.median([compute(_FLAGS.steps)[0] for _ in range(3)])
        t_free = np.median([time_input(free, _FLAGS.steps)[0] for _ in range(3)])
        delay = max(t_compute - t_free, 0.0)

    stream = slow_stream(dataset, delay)
    iterators = {mode: iter(trainers[mode].staging.pipeline(stream)) for mode in MODES}
    input_only = iter(trainers["host"].staging.pipeline(stream))
    systems = {
        "compute": compute,
        "input": lambda steps: time_input(input_only, steps),
        **{mode: (lambda steps, m=mode: time_training(trainers[m], iterators[m], steps))
           for mode in MODES},
    }
    for run in systems.values():
        for _ in range(_FLAGS.warmup):
            run(_FLAGS.steps)
    times = {name: [] for name in systems}
    waits = {name: [] for name in systems}
    for _ in range(_FLAGS.repeats):
        for name, run in systems.items():
            step_time, wait = run(_FLAGS.steps)
            times[name].append(step_time)
            waits[name].append(wait)
    median = {name: float(np.median(values)) for name, values in times.items()}
    ideal = max(median["input"], median["compute"])
    batch_size = _FLAGS.global_batch_size
    rows = []
    for name in systems:
        rows.append({
            "system": name, "median_step_s": median[name],
            "mad_step_s": float(np.median(np.abs(np.array(times[name]) - median[name]))),
            "examples_per_sec": batch_size / median[name],
            "ratio_to_ideal": ideal / median[name] if name in MODES else None,
            "speedup_over_none": median["none"] / median[name] if name in MODES else None,
            "input_wait_s": float(np.median(waits[name])) if name in MODES else None})
    print(f"model {_FLAGS.model}, --devices={_FLAGS.devices}, --aggregation="
          f"{_FLAGS.aggregation}, global batch {batch_size}, K={_FLAGS.staging_depth}, "
          f"delay {1e3 * delay:.2f} ms/batch, {_FLAGS.steps} steps/loop, {_FLAGS.repeats} "
          f"interleaved repeats; t_input {1e3 * median['input']:.2f} ms, t_compute "
          f"{1e3 * median['compute']:.2f} ms; ideal {batch_size / ideal:.0f} examples/sec")
    print(f"command: python {' '.join(sys.argv)}")
    print("| system | median step (ms) | MAD (ms) | examples/sec | ratio to ideal | "
          "speed-up over none | input wait (ms/step) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        def fmt(value, pattern):
            return "" if value is None else pattern.format(value)
        print(f"| {row['system']} | {1e3 * row['median_step_s']:.2f} | "
              f"{1e3 * row['mad_step_s']:.2f} | {row['examples_per_sec']:.0f} | "
              f"{fmt(row['ratio_to_ideal'], '{:.2f}')} | "
              f"{fmt(row['speedup_over_none'], '{:.2f}x')} | "
              f"{fmt(row['input_wait_s'] and 1e3 * row['input_wait_s'], '{:.2f}')} |")
    if _FLAGS.json_out:
        with open(_FLAGS.json_out, "w") as handle:
            json.dump({"delay_s": delay, "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    app.run(main)
