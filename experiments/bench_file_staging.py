"""Does staging stay asynchronous when the input reads files? `device` vs `none` (and `host`).

    python experiments/bench_file_staging.py --json_out=/tmp/bench_file_staging.json

(defaults: `--model=cnn --devices=cpu:2 --aggregation=reduce_broadcast --global_batch_size=128
--staging_depth=2 --examples=4096 --files=8 --input_delay_ms=auto --steps=30 --warmup=2
--repeats=7`; a quick check that it runs: `--steps=3 --repeats=1 --examples=512`.)

The input is a user's file pipeline as `mgloop.data.as_input` reads it: TFRecord files of
32x32x3 uint8 images and int labels (written once to --data_dir, default a temporary
folder), `TFRecordDataset` -> `parse_single_example` -> `decode_raw` -> float32 / 255, cut
into global batches by `as_input` (unbatched examples, --drop_remainder). A fixed per-batch
delay (a `tf.py_function` that sleeps, standing for a read from a slow disk or network or a
decode on other cores) is added to every global batch; `auto` calibrates it in the same
invocation so that t_input ~ t_compute. Rows:

    compute   a trainer (`device` staging) on one constant batch: t_compute per step
    input     the file pipeline alone (with the delay), prefetched as host/device read it,
              pulled in a compiled loop: t_input per batch
    none, host, device   trainers that differ only in --staging, on the file pipeline

All are built in this process and timed in interleaved repeats (median over repeats of
`--steps` steps in one compiled loop, after `--warmup` loops). Ideal step time =
max(t_input, t_compute); `ratio to ideal` = ideal / median step (target >= 0.9 for device).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

import benchlib  # noqa: E402

_FLAGS = flags.FLAGS
flags.DEFINE_string("model", "cnn", "mgloop model name")
flags.DEFINE_string("devices", "cpu:2", "towers")
flags.DEFINE_string("aggregation", "reduce_broadcast", "aggregation method")
flags.DEFINE_integer("global_batch_size", 128, "examples per step")
flags.DEFINE_integer("staging_depth", 2, "batches staged ahead (host and device)")
flags.DEFINE_integer("examples", 4096, "training examples written to the files")
flags.DEFINE_integer("files", 8, "TFRecord files")
flags.DEFINE_string("data_dir", None, "where to write the files (default: a temporary folder)")
flags.DEFINE_string("input_delay_ms", "auto", "per-batch delay; auto: t_input = t_compute")
flags.DEFINE_integer("steps", 30, "steps per timed loop")
flags.DEFINE_integer("warmup", 2, "untimed loops per system first")
flags.DEFINE_integer("repeats", 7, "timed loops per system (interleaved)")
flags.DEFINE_string("json_out", None, "write the rows as JSON here")

SHAPE = (32, 32, 3)


def write_files(folder: str, examples: int, files: int, seed: int = 0) -> list[str]:
    import tensorflow as tf
    rng = np.random.default_rng(seed)
    paths = []
    for index, part in enumerate(np.array_split(np.arange(examples), files)):
        path = os.path.join(folder, f"train-{index:03d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for _ in part:
                image = rng.integers(0, 256, SHAPE, dtype=np.uint8).tobytes()
                label = int(rng.integers(10))
                writer.write(tf.train.Example(features=tf.train.Features(feature={
                    "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label]))})
                ).SerializeToString())
        paths.append(path)
    return paths


def file_examples(paths):
    import tensorflow as tf
    spec = {"image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64)}

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        image = tf.reshape(tf.io.decode_raw(example["image"], tf.uint8), SHAPE)
        return tf.cast(image, tf.float32) / 255.0, tf.cast(example["label"], tf.int32)
    return tf.data.TFRecordDataset(paths).map(parse)


def with_delay(batches, seconds: float):
    import tensorflow as tf
    if seconds <= 0:
        return batches

    def sleep(x, y):
        def wait():
            time.sleep(seconds)
            return np.float32(0)
        done = tf.py_function(wait, [], tf.float32)
        with tf.control_dependencies([done]):
            return tf.identity(x), tf.identity(y)
    return batches.map(sleep)


def main(argv):
    del argv
    from mgloop.cluster import devices
    device_set = devices.setup(devices.parse(_FLAGS.devices))  # before any TensorFlow op
    import tensorflow as tf
    from mgloop import data, models
    from mgloop.runs import experiment
    from mgloop.runs.config import Config

    folder = _FLAGS.data_dir or tempfile.mkdtemp(prefix="mgloop-file-staging-")
    paths = write_files(folder, _FLAGS.examples, _FLAGS.files)

    def build(staging):
        config = Config(model=_FLAGS.model, devices=_FLAGS.devices,
                        aggregation=_FLAGS.aggregation, global_batch_size=_FLAGS.global_batch_size,
                        staging=staging, staging_depth=_FLAGS.staging_depth, diagnostics=False,
                        train_steps=10 ** 9, logdir=os.path.join(folder, "logdir")).validated()
        trainer = experiment.build_trainer(
            config, device_set, lambda: models.get(_FLAGS.model)(SHAPE, 10),
            experiment.default_loss(), SHAPE)
        return config, trainer

    def file_batches(config, delay):
        return with_delay(data.as_input(file_examples(paths), config).train_batches(0), delay)

    def timed(trainer, iterator):
        began = time.perf_counter()
        result = trainer.train_loop(iterator, _FLAGS.steps)
        assert result.steps == _FLAGS.steps
        return (time.perf_counter() - began) / _FLAGS.steps

    # compute: one constant batch, device staging
    config, compute = build("device")
    x, y = next(iter(file_batches(config, 0.0)))
    compute_iter = iter(compute.staging.pipeline(tf.data.Dataset.from_tensors((x, y)).repeat()))

    @tf.function
    def pull(iterator, steps):
        total = tf.constant(0, tf.int32)
        for _ in tf.range(steps):
            total += tf.reduce_sum(next(iterator)[1])
        return total

    def input_time(delay):
        iterator = iter(file_batches(config, delay).prefetch(_FLAGS.staging_depth))
        pull(iterator, _FLAGS.steps)
        times = []
        for _ in range(max(_FLAGS.repeats // 2, 1)):
            began = time.perf_counter()
            pull(iterator, _FLAGS.steps)
            times.append((time.perf_counter() - began) / _FLAGS.steps)
        return float(np.median(times))

    for _ in range(_FLAGS.warmup):
        timed(compute, compute_iter)
    t_compute = float(np.median([timed(compute, compute_iter) for _ in range(3)]))
    if _FLAGS.input_delay_ms == "auto":
        delay = max(t_compute - input_time(0.0), 0.0)
    else:
        delay = float(_FLAGS.input_delay_ms) / 1e3

    systems = {"compute": (compute, compute_iter)}
    for staging in ("none", "host", "device"):
        cfg, trainer = build(staging)
        systems[staging] = (trainer, iter(trainer.staging.pipeline(file_batches(cfg, delay))))
    for trainer, iterator in systems.values():
        for _ in range(_FLAGS.warmup):
            timed(trainer, iterator)
    times = {name: [] for name in systems}
    for _ in range(_FLAGS.repeats):  # interleaved: load changes hit every system alike
        for name, (trainer, iterator) in systems.items():
            times[name].append(timed(trainer, iterator))
    t_input = input_time(delay)
    t_compute = float(np.median(times["compute"]))
    ideal = max(t_input, t_compute)
    rows = [{"system": "input", "step_ms": 1e3 * t_input, "mad_ms": None,
             "examples_per_sec": _FLAGS.global_batch_size / t_input}]
    for name, values in times.items():
        median, mad = benchlib.median_and_mad(values)
        rows.append({"system": name, "step_ms": 1e3 * median, "mad_ms": 1e3 * mad,
                     "examples_per_sec": _FLAGS.global_batch_size / median,
                     "ratio_to_ideal": ideal / median if name != "compute" else None,
                     "speedup_over_none": (float(np.median(times["none"])) / median
                                           if name in ("host", "device") else None)})
    header = (f"delay {1e3 * delay:.2f} ms/batch; t_input {1e3 * t_input:.2f} ms, t_compute "
              f"{1e3 * t_compute:.2f} ms; ideal {_FLAGS.global_batch_size / ideal:.0f} "
              f"examples/sec\n(files: {len(paths)} TFRecord files in {folder})")
    benchlib.report(header, rows, [
        ("system", "system", ""), ("step_ms", "median step (ms)", ".2f"),
        ("mad_ms", "MAD (ms)", ".2f"), ("examples_per_sec", "examples/sec", ".0f"),
        ("ratio_to_ideal", "ratio to ideal", ".2f"),
        ("speedup_over_none", "speed-up over none", ".2f")], _FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
