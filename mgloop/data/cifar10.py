"""`cifar10`: the CIFAR-10 binary version (cifar-10-batches-bin), read with tf.data.

Files in `--data_dir`: data_batch_1.bin .. data_batch_5.bin (training, in that
order) and test_batch.bin (eval). Each is a run of 3073-byte records: one label
byte (0..9), then 3072 pixel bytes, the three 32x32 colour planes R, G, B, each
row-major. Records become uint8 HWC images [32, 32, 3], kept so in host memory.

Per batch, an image x becomes float32 inputs x / 255 - m, where m [3] is the
per-channel mean of x / 255 over every training pixel (eval uses the training
mean too). Training batches are then augmented: zero-padded by 4 pixels (zero is
the mean colour), randomly cropped back to 32x32 and mirrored left-right with
probability 1/2 (augment.random_crop_and_flip), seeded by (seed, step).
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from mgloop.data import augment as augment_lib
from mgloop.data import files
from mgloop.data.base import InMemoryDataset

TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
EVAL_FILE = "test_batch.bin"
HEIGHT = WIDTH = 32
CHANNELS = 3
RECORD_BYTES = 1 + CHANNELS * HEIGHT * WIDTH  # 3073
NUM_CLASSES = 10
PAD = 4
EXPECTED_FILES = (f"--dataset=cifar10 reads {', '.join(TRAIN_FILES)} and {EVAL_FILE} "
                  "(the binary version, cifar-10-batches-bin)")
RECORD_FORMAT = (f"a CIFAR-10 batch file holds whole records of {RECORD_BYTES} bytes "
                 "(1 label byte + 3072 pixel bytes), at least one")


def check_files(data_dir: str) -> None:
    """Every file is there, holds whole records, and has labels 0..9 (plain Python reads)."""
    for name in TRAIN_FILES + (EVAL_FILE,):
        path = files.require_file(data_dir, name, EXPECTED_FILES)
        size = os.path.getsize(path)
        if size == 0 or size % RECORD_BYTES:
            raise files.refuse(data_dir, f"{path} has {size} bytes; {RECORD_FORMAT}")
        records = np.memmap(path, dtype=np.uint8, mode="r").reshape(-1, RECORD_BYTES)
        labels = np.array(records[:, 0])  # touches every record's first byte, copies only those
        del records
        files.check_labels(data_dir, path, labels, NUM_CLASSES)


def decode_records(records: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Raw records (string [K]) -> images uint8 [K, 32, 32, 3] (HWC), labels int32 [K]."""
    raw = tf.io.decode_raw(records, tf.uint8)  # [K, 3073]
    labels = tf.cast(raw[:, 0], tf.int32)
    planes = tf.reshape(raw[:, 1:], [-1, CHANNELS, HEIGHT, WIDTH])  # CHW, as stored
    return tf.transpose(planes, [0, 2, 3, 1]), labels


def read_file(path: str) -> tuple[np.ndarray, np.ndarray]:
    """One checked batch file, with tf.data: images uint8 [N, 32, 32, 3], labels int32 [N]."""
    records = tf.data.FixedLengthRecordDataset(path, RECORD_BYTES).batch(10000)
    parts = [(x.numpy(), y.numpy()) for x, y in records.map(decode_records)]
    return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])


def channel_mean(images: np.ndarray) -> np.ndarray:
    """Mean of x / 255 per channel over every pixel of `images` [N, H, W, C]: float32 [C].

    The sums are exact integers (summed over examples first, a fast contiguous reduction)."""
    per_position = images.reshape(len(images), -1).sum(axis=0, dtype=np.uint64)  # [H*W*C]
    totals = per_position.reshape(-1, images.shape[-1]).sum(axis=0)  # [C]
    pixels = images.size // images.shape[-1]
    return (totals / (255.0 * pixels)).astype(np.float32)


def make_prepare(mean: np.ndarray):
    mean = tf.constant(mean, tf.float32)

    def prepare(images: tf.Tensor) -> tf.Tensor:
        """uint8 [B, 32, 32, 3] -> float32 x / 255 - mean."""
        return tf.cast(images, tf.float32) / 255.0 - mean
    return prepare


def augment(inputs: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    return augment_lib.random_crop_and_flip(inputs, seed, PAD)


def load(data_dir: str) -> InMemoryDataset:
    """Checks the files (as validation does, so a direct call is safe too), then reads them."""
    check_files(data_dir)
    parts = [read_file(os.path.join(data_dir, name)) for name in TRAIN_FILES]
    train_x = np.concatenate([x for x, _ in parts])
    train_y = np.concatenate([y for _, y in parts])
    eval_x, eval_y = read_file(os.path.join(data_dir, EVAL_FILE))
    return InMemoryDataset("cifar10", train_x, train_y, eval_x, eval_y, NUM_CLASSES,
                           prepare=make_prepare(channel_mean(train_x)), augment=augment)
