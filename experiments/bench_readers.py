"""Host input cost of the CIFAR-10 reader: prepared-only batches against augmented ones.

    python experiments/bench_readers.py [--data_dir=DIR]

Without --data_dir it writes full-size random CIFAR-10 binary files (50,000 +
10,000 records, 184 MB) to a temp folder first (removed at the end). Reported once: the time to
check the files (validation) and to load them (tf.data parse + channel mean).
Then the training input stream (`train_batches`) is timed in three variants, each
an iterator made once and read on the host (no model): `prepare` only (uint8 ->
x/255 - mean, the baseline), `prepare + augment` (pad-4 crop and flip, the
default), and the synthetic dataset for scale. Repeats are interleaved;
reported: median ms per global batch, examples/sec, ratio to the baseline.
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


def measure(directory: str) -> None:
    from mgloop import data
    began = time.perf_counter()
    data.check("cifar10", directory)
    check_s = time.perf_counter() - began
    began = time.perf_counter()
    cifar = data.load("cifar10", 0, directory)
    load_s = time.perf_counter() - began
    batch = _FLAGS.global_batch_size
    variants = {
        "cifar10 prepare": dataclasses.replace(cifar, augment=None),
        "cifar10 prepare + augment": cifar,
        "synthetic (8x8x3 float32)": data.load("synthetic", 0),
    }
    iterators = {name: iter(ds.train_batches(batch, seed=0)) for name, ds in variants.items()}
    for iterator in iterators.values():
        time_batches(iterator, _FLAGS.batches)  # warm-up: tensors, tracing
    times = {name: [] for name in variants}
    for _ in range(_FLAGS.repeats):
        for name, iterator in iterators.items():
            times[name].append(time_batches(iterator, _FLAGS.batches))
    base = float(np.median(times["cifar10 prepare"]))
    print(f"command: python {' '.join(sys.argv)}")
    print(f"check files {check_s:.2f} s, load {load_s:.2f} s ({len(cifar.train_y)} train + "
          f"{len(cifar.eval_y)} eval records); global batch {batch}, {_FLAGS.batches} "
          f"batches/repeat, {_FLAGS.repeats} interleaved repeats")
    print("| input stream | median ms/batch | examples/sec | time ratio to prepare |")
    print("|---|---|---|---|")
    for name in variants:
        median = float(np.median(times[name]))
        print(f"| {name} | {1e3 * median:.2f} | {batch / median:.0f} | {median / base:.2f} |")


if __name__ == "__main__":
    app.run(main)
