"""Host input cost of the CIFAR-10 reader: prepared-only batches against augmented ones.

    python experiments/bench_readers.py [--data_dir=DIR]

Without --data_dir it writes full-size random CIFAR-10 binary files (50,000 +
10,000 records, 184 MB) to a temp folder first (removed at the end). Reported once: the time to
check the files (validation) and to load them (tf.data parse + channel mean).
Then the training input stream (`train_batches`) is timed in three variants, each
an iterator made once and read on the host (no model): `prepare` only (uint8 ->
x/255 - mean, the baseline), `prepare + augment` (pad-4 crop and flip, the
default), and the synthetic dataset for scale; beside them, one training step of
`--model` on one tower with a cached batch (the compute the input must keep up
with). Repeats are interleaved; reported: median ms per global batch,
examples/sec, ratio to the baseline.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

_FLAGS = flags.FLAGS
flags.DEFINE_string("data_dir", None, "CIFAR-10 binary folder (default: write random files)")
flags.DEFINE_integer("global_batch_size", 128, "examples per batch")
flags.DEFINE_integer("batches", 50, "batches per timed repeat")
flags.DEFINE_integer("repeats", 7, "timed repeats per variant, interleaved")
flags.DEFINE_string("model", "cnn", "also time a train step of this model (empty: skip)")


def write_random_cifar10(directory: str) -> None:
    rng = np.random.default_rng(0)
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    for name in names:
        records = rng.integers(0, 256, size=(10000, 3073), dtype=np.uint8)
        records[:, 0] %= 10
        records.tofile(os.path.join(directory, name))


def time_batches(iterator, count: int) -> float:
    began = time.perf_counter()
    for _ in range(count):
        x, _ = next(iterator)
    x.numpy()
    return (time.perf_counter() - began) / count


def main(argv):
    del argv
    directory = _FLAGS.data_dir
    if directory is None:
        directory = tempfile.mkdtemp(prefix="mgloop-cifar10-")
        write_random_cifar10(directory)
    try:
        measure(directory)
    finally:
        if _FLAGS.data_dir is None:
            shutil.rmtree(directory)


def model_step_timer(cifar, directory: str, batch: int):
    """Seconds per training step of `--model` on one tower (cpu:1) on a cached batch, so the
    input stream is not in the time: the compute the input has to keep up with."""
    import tensorflow as tf
    from mgloop import models
    from mgloop.cluster import devices
    from mgloop.runs import experiment
    from mgloop.runs.config import Config
    config = Config(devices="cpu:1", aggregation="ps_cpu", model=_FLAGS.model, dataset="cifar10",
                    data_dir=directory, global_batch_size=batch,
                    logdir=tempfile.mkdtemp(prefix="mgloop-bench-")).validated()
    device_set = devices.setup(devices.parse(config.devices, config.towers_per_device))
    trainer = experiment.build_trainer(
        config, device_set, lambda: models.get(_FLAGS.model)(cifar.input_shape, 10),
        experiment.default_loss(), cifar.input_shape)
    iterator = iter(cifar.train_batches(batch, seed=0).take(1).cache().repeat())
    steps = max(1, _FLAGS.batches // 5)

    def timer(_):
        began = time.perf_counter()
        trainer.train_loop(iterator, steps)
        return (time.perf_counter() - began) / steps
    return timer, config.logdir


def measure(directory: str) -> None:
    from mgloop import data
    began = time.perf_counter()
    data.check("cifar10", directory)
    check_s = time.perf_counter() - began
    began = time.perf_counter()
    cifar = data.load("cifar10", 0, directory)
    load_s = time.perf_counter() - began
    batch = _FLAGS.global_batch_size
    datasets = {
        "cifar10 prepare": dataclasses.replace(cifar, augment=None),
        "cifar10 prepare + augment": cifar,
        "synthetic (8x8x3 float32)": data.load("synthetic", 0),
    }
    timers = {}
    for name, dataset in datasets.items():
        iterator = iter(dataset.train_batches(batch, seed=0))
        timers[name] = lambda count, iterator=iterator: time_batches(iterator, count)
    logdir = None
    if _FLAGS.model:
        timers[f"{_FLAGS.model} train step, cpu:1, cached input"], logdir = model_step_timer(
            cifar, directory, batch)
    for timer in timers.values():
        timer(_FLAGS.batches)  # warm-up: tensors, tracing
    times = {name: [] for name in timers}
    for _ in range(_FLAGS.repeats):
        for name, timer in timers.items():
            times[name].append(timer(_FLAGS.batches))
    if logdir:
        shutil.rmtree(logdir)
    base = float(np.median(times["cifar10 prepare"]))
    print(f"command: python {' '.join(sys.argv)}")
    print(f"check files {check_s:.2f} s, load {load_s:.2f} s ({len(cifar.train_y)} train + "
          f"{len(cifar.eval_y)} eval records); global batch {batch}, {_FLAGS.batches} "
          f"batches/repeat, {_FLAGS.repeats} interleaved repeats")
    print("| per global batch | median ms | examples/sec | time ratio to prepare |")
    print("|---|---|---|---|")
    for name in timers:
        median = float(np.median(times[name]))
        print(f"| {name} | {1e3 * median:.2f} | {batch / median:.0f} | {median / base:.2f} |")


if __name__ == "__main__":
    app.run(main)
