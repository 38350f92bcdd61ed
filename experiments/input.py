"""The input path: what reading costs on the host, and whether staging hides it.

    python -m experiments.input readers [--data_dir=DIR]
    python -m experiments.input file_staging --json_out=/tmp/file_staging.json

(a quick check that each runs: `readers --batches=5 --rounds=1`, `file_staging --steps=3
--rounds=1 --examples=512`.) Everything is timed side by side in this process over
`--rounds` rounds in rotated order, after `--warmup` untimed calls each, medians
over the rounds (experiments/benchlib.py). Slow inputs for the tower-loop variants
(`--input_delay_ms`, `--measure=ideal`) are experiments/variants.py's.

`readers`: host input cost of the CIFAR-10 reader, prepared-only batches against
augmented ones. Without --data_dir it writes full-size random CIFAR-10 binary files
(50,000 + 10,000 records, 184 MB) to a temp folder first (removed at the end). Reported
once: the time to check the files (validation) and to load them (tf.data parse + channel
mean). Then the training input stream (`train_batches`) is timed in three variants, each
an iterator made once and read on the host (no model), `--batches` global batches per
call: `prepare` only (uint8 -> x/255 - mean, the baseline of the ratios), `prepare +
augment` (pad-4 crop and flip, the default), and the synthetic dataset for scale;
beside them, training steps of `--model` on one tower with a cached batch (the compute
the input must keep up with). Reported: median ms per global batch, examples/sec, ratio
to the baseline.

`file_staging`: does staging stay asynchronous when the input reads files? `device` vs
`none` (and `host`). The input is a user's file pipeline as `mgloop.data.as_input` reads
it: TFRecord files of 32x32x3 uint8 images and int labels (`--examples` in `--files`
files, written once to --data_dir, default a temporary folder), `TFRecordDataset` ->
`parse_single_example` -> `decode_raw` -> float32 / 255, cut into global batches by
`as_input`. A fixed per-batch delay (a `tf.py_function` that sleeps, standing for a read
from a slow disk or network or a decode on other cores) is added to every global batch;
`--input_delay_ms=auto` calibrates it in the same invocation so that t_input ~ t_compute.
Rows:

    input     the file pipeline alone (with the delay), prefetched as host/device read it,
              pulled in a compiled loop: t_input per batch, from `--rounds` / 2 calls one
              after another after the rounds (side by side, its prefetch buffer would
              fill while the others run)
    compute   a trainer (`device` staging) on one constant batch: t_compute per step
    none, host, device   trainers that differ only in --staging, on the file pipeline

Each timed call is one compiled loop of `--steps` steps; compute, none, host and device
run side by side. Ideal step time =
max(t_input, t_compute); `ratio to ideal` = ideal / median step (target >= 0.9 for
device); `speed-up over none` = none's median step / the row's.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time

from absl import app, flags
import numpy as np

from experiments import benchlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "cnn", "mgloop model name (readers: its train step beside the "
                    "readers; empty: skip it)")
flags.DEFINE_integer("global_batch_size", 128, "examples per step")
flags.DEFINE_string("data_dir", None, "readers: a CIFAR-10 binary folder (default: write "
                    "random files); file_staging: where to write the TFRecord files "
                    "(default: a temporary folder)")
flags.DEFINE_integer("rounds", 7, "rounds side by side")
flags.DEFINE_integer("warmup", None, "untimed calls of each case first (default: readers 1, "
                     "file_staging 2)")
flags.DEFINE_integer("batches", 50, "readers: global batches per timed call")
flags.DEFINE_string("devices", "cpu:2", "file_staging: towers")
flags.DEFINE_string("aggregation", "reduce_broadcast", "file_staging: aggregation method")
flags.DEFINE_integer("staging_depth", 2, "file_staging: batches staged ahead (host and device)")
flags.DEFINE_integer("examples", 4096, "file_staging: training examples written to the files")
flags.DEFINE_integer("files", 8, "file_staging: TFRecord files")
flags.DEFINE_string("input_delay_ms", "auto", "file_staging: per-batch delay; auto: t_input "
                    "= t_compute")
flags.DEFINE_integer("steps", 30, "file_staging: steps per timed loop")
flags.DEFINE_string("json_out", None, "write the rows (with command, settings, machine) here")


# --- readers ------------------------------------------------------------------------------

def write_random_cifar10(directory: str) -> None:
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    for name in names:
        records = rng.integers(0, 256, size=(10000, 3073), dtype=np.uint8)
        records[:, 0] %= 10
        records.tofile(os.path.join(directory, name))


def batches_timer(iterator, count: int):
    """A run for benchlib.rounds: seconds per global batch read from `iterator`."""
    def read():
        for _ in range(count):
            x, _ = next(iterator)
        x.numpy()
    return benchlib.timer(read, count)


def model_step_timer(cifar, directory: str, batch: int):
    """Seconds per training step of `--model` on one tower (cpu:1) on a cached batch, so the
    input stream is not in the time: the compute the input has to keep up with."""
    from mgloop import models
    from mgloop.cluster import devices
    from mgloop.runs import experiment
    from mgloop.runs.config import Config
    config = Config(devices="cpu:1", aggregation="ps_cpu", model=FLAGS.model, dataset="cifar10",
                    data_dir=directory, global_batch_size=batch,
                    logdir=tempfile.mkdtemp(prefix="mgloop-bench-")).validated()
    device_set = devices.setup(devices.parse(config.devices, config.towers_per_device))
    trainer = experiment.build_trainer(
        config, device_set, lambda: models.get(FLAGS.model)(cifar.input_shape, 10),
        experiment.default_loss(), cifar.input_shape)
    iterator = iter(cifar.train_batches(batch, seed=0).take(1).cache().repeat())
    steps = max(1, FLAGS.batches // 5)
    return benchlib.timer(lambda: trainer.train_loop(iterator, steps), steps), config.logdir


def readers(args) -> None:
    del args
    directory = FLAGS.data_dir
    if directory is None:
        directory = tempfile.mkdtemp(prefix="mgloop-cifar10-")
        write_random_cifar10(directory)
    try:
        measure_readers(directory)
    finally:
        if FLAGS.data_dir is None:
            shutil.rmtree(directory)


def measure_readers(directory: str) -> None:
    from mgloop import data
    began = time.perf_counter()
    data.check("cifar10", directory)
    check_s = time.perf_counter() - began
    began = time.perf_counter()
    cifar = data.load("cifar10", 0, directory)
    load_s = time.perf_counter() - began
    batch = FLAGS.global_batch_size
    datasets = {
        "cifar10 prepare": dataclasses.replace(cifar, augment=None),
        "cifar10 prepare + augment": cifar,
        "synthetic (8x8x3 float32)": data.load("synthetic", 0),
    }
    runs = {name: batches_timer(iter(dataset.train_batches(batch, seed=0)), FLAGS.batches)
            for name, dataset in datasets.items()}
    logdir = None
    if FLAGS.model:
        runs[f"{FLAGS.model} train step, cpu:1, cached input"], logdir = model_step_timer(
            cifar, directory, batch)
    rows = benchlib.summarize(benchlib.rounds(runs, FLAGS.rounds, FLAGS.warmup),
                              "per global batch")
    if logdir:
        shutil.rmtree(logdir)
    benchlib.add_ratio(rows, "median", "cifar10 prepare", name="per global batch")
    for row in rows:
        row.update(ms=1e3 * row["median"], examples_per_sec=batch / row["median"])
    benchlib.publish(
        f"check files {check_s:.2f} s, load {load_s:.2f} s ({len(cifar.train_y)} train + "
        f"{len(cifar.eval_y)} eval records); global batch {batch}, {FLAGS.batches} "
        f"batches per call, {FLAGS.rounds} rounds side by side", rows,
        [("per global batch", "per global batch", "s"), ("ms", "median ms", ".2f"),
         ("examples_per_sec", "examples/sec", ".0f"),
         ("ratio", "time ratio to prepare", ".2f")], FLAGS.json_out,
        {"global_batch_size": batch, "batches": FLAGS.batches, "rounds": FLAGS.rounds,
         "warmup": FLAGS.warmup, "model": FLAGS.model, "check_s": check_s, "load_s": load_s})


# --- file_staging -------------------------------------------------------------------------

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


def file_staging(args) -> None:
    del args
    from mgloop.cluster import devices
    device_set = devices.setup(devices.parse(FLAGS.devices))  # before any TensorFlow op
    import tensorflow as tf
    from mgloop import data, models
    from mgloop.runs import experiment, run_inputs
    from mgloop.runs.config import Config

    folder = FLAGS.data_dir or tempfile.mkdtemp(prefix="mgloop-file-staging-")
    paths = write_files(folder, FLAGS.examples, FLAGS.files)
    steps = FLAGS.steps

    def build(staging):
        config = Config(model=FLAGS.model, devices=FLAGS.devices,
                        aggregation=FLAGS.aggregation, global_batch_size=FLAGS.global_batch_size,
                        staging=staging, staging_depth=FLAGS.staging_depth, diagnostics=False,
                        train_steps=10 ** 9, logdir=os.path.join(folder, "logdir")).validated()
        trainer = experiment.build_trainer(
            config, device_set, lambda: models.get(FLAGS.model)(SHAPE, 10),
            experiment.default_loss(), SHAPE)
        return config, trainer

    def file_batches(config, delay):
        made = data.as_input(file_examples(paths), config.data, run_inputs.reading(config))
        return with_delay(made.train_batches(0), delay)

    def loop(trainer, iterator):
        def run():
            assert trainer.train_loop(iterator, steps).steps == steps
        return benchlib.timer(run, steps)

    # compute: one constant batch, device staging
    config, compute = build("device")
    x, y = next(iter(file_batches(config, 0.0)))
    compute_loop = loop(compute, iter(compute.staging.pipeline(
        tf.data.Dataset.from_tensors((x, y)).repeat())))

    @tf.function
    def pull(iterator, count):
        total = tf.constant(0, tf.int32)
        for _ in tf.range(count):
            total += tf.reduce_sum(next(iterator)[1])
        return total

    def input_time(delay, count) -> list[float]:
        """t_input: `count` calls one after another (after one untimed), not side by side:
        between the calls of a round the prefetch buffer would fill and hide the delay."""
        iterator = iter(file_batches(config, delay).prefetch(FLAGS.staging_depth))
        return benchlib.rounds({"input": benchlib.timer(lambda: pull(iterator, steps), steps)},
                               count, warmup=1)["input"]

    if FLAGS.input_delay_ms == "auto":
        for _ in range(FLAGS.warmup):
            compute_loop()
        t_compute = benchlib.median_and_mad([compute_loop() for _ in range(3)])[0]
        delay = max(t_compute - benchlib.median_and_mad(input_time(0.0, 3))[0], 0.0)
    else:
        delay = float(FLAGS.input_delay_ms) / 1e3

    runs = {"compute": compute_loop}
    for staging in ("none", "host", "device"):
        cfg, trainer = build(staging)
        runs[staging] = loop(trainer, iter(trainer.staging.pipeline(file_batches(cfg, delay))))
    samples = benchlib.rounds(runs, FLAGS.rounds, FLAGS.warmup)
    samples = {"input": input_time(delay, max(FLAGS.rounds // 2, 1)), **samples}
    rows = benchlib.summarize(samples, "system")
    by = {row["system"]: row for row in rows}
    t_input, t_compute = by["input"]["median"], by["compute"]["median"]
    ideal = max(t_input, t_compute)
    benchlib.add_ratio(rows, "median", "none", "speedup_over_none", "system", inverse=True)
    for row in rows:
        row.update(step_ms=1e3 * row["median"], mad_ms=1e3 * row["mad"],
                   examples_per_sec=FLAGS.global_batch_size / row["median"])
        row["ratio_to_ideal"] = (ideal / row["median"]
                                 if row["system"] in ("none", "host", "device") else None)
        if row["system"] not in ("host", "device"):
            row["speedup_over_none"] = None
    header = (f"delay {1e3 * delay:.2f} ms/batch; t_input {1e3 * t_input:.2f} ms, t_compute "
              f"{1e3 * t_compute:.2f} ms; ideal {FLAGS.global_batch_size / ideal:.0f} "
              f"examples/sec\n(files: {len(paths)} TFRecord files in {folder})")
    benchlib.publish(header, rows, [
        ("system", "system", ""), ("step_ms", "median step (ms)", ".2f"),
        ("mad_ms", "MAD (ms)", ".2f"), ("examples_per_sec", "examples/sec", ".0f"),
        ("ratio_to_ideal", "ratio to ideal", ".2f"),
        ("speedup_over_none", "speed-up over none", ".2f")], FLAGS.json_out,
        {name: getattr(FLAGS, name) for name in (
            "model", "devices", "aggregation", "global_batch_size", "staging_depth",
            "examples", "files", "input_delay_ms", "steps", "warmup", "rounds")}
        | {"delay_ms": 1e3 * delay})


COMMANDS = {"readers": (readers, {"warmup": 1}),
            "file_staging": (file_staging, {"warmup": 2})}


if __name__ == "__main__":
    app.run(lambda argv: benchlib.dispatch(argv, COMMANDS))
