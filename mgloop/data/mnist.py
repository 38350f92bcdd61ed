"""`mnist`: MNIST in the IDX format, each file plain or gzip-compressed (`.gz`).

Files in `--data_dir`: train-images-idx3-ubyte, train-labels-idx1-ubyte (training),
t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (eval), each optionally with a
`.gz` suffix (a plain file wins over its `.gz`). IDX headers are big-endian
uint32s: an image file holds magic 0x00000803, count, rows, cols, then
count*rows*cols pixel bytes (row-major); a label file holds magic 0x00000801,
count, then count label bytes (0..9). The data are read with tf.data and kept
as uint8 [N, 28, 28, 1]; a batch becomes float32 inputs x / 255 in [0, 1].
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib

import numpy as np
import tensorflow as tf

from mgloop.data import files
from mgloop.data.base import InMemoryDataset

SPLITS = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          "eval": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
IMAGES_MAGIC, LABELS_MAGIC = 0x00000803, 0x00000801
IMAGES_HEADER, LABELS_HEADER = 16, 8  # bytes: magic + 3 dims, magic + 1 dim
ROWS = COLS = 28
NUM_CLASSES = 10
EXPECTED_FILES = ("--dataset=mnist reads " + ", ".join(n for pair in SPLITS.values() for n in pair)
                  + " (IDX format, each optionally gzip-compressed as NAME.gz)")
IMAGES_FORMAT = ("an IDX image file starts with magic 0x00000803, then count, rows, cols as "
                 "big-endian uint32")
LABELS_FORMAT = "an IDX label file starts with magic 0x00000801, then count as big-endian uint32"


def find_file(data_dir: str, name: str) -> str:
    """`name` in `data_dir`, else `name.gz`; refuses when neither is there."""
    for candidate in (name, name + ".gz"):
        path = os.path.join(data_dir, candidate)
        if os.path.isfile(path):
            return path
    raise files.refuse(data_dir, f"{os.path.join(data_dir, name)} (or .gz) is missing; "
                                 f"{EXPECTED_FILES}")


def _is_gzip(path: str) -> bool:
    return path.endswith(".gz")


def _read_bytes(data_dir: str, path: str, size: int | None, expected: str) -> bytes:
    """The first `size` bytes (None: all) of the file's content, decompressed if gzipped."""
    try:
        with (gzip.open(path, "rb") if _is_gzip(path) else open(path, "rb")) as handle:
            return handle.read() if size is None else handle.read(size)
    except (OSError, EOFError, zlib.error) as error:  # gzip.BadGzipFile is an OSError
        raise files.read_error(data_dir, path, error, expected) from None


def _content_length(data_dir: str, path: str, expected: str) -> tuple[int, str]:
    """Bytes of content and a phrase naming them; a gzip stream is decompressed to count
    (about 0.3 s for MNIST's largest file), so a truncated stream is found here."""
    if not _is_gzip(path):
        return os.path.getsize(path), "bytes"
    length = 0
    try:
        with gzip.open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                length += len(chunk)
    except (OSError, EOFError, zlib.error) as error:
        raise files.read_error(data_dir, path, error, expected) from None
    return length, "bytes uncompressed"


def _check_length(data_dir: str, path: str, needed: int, what: str, expected: str) -> None:
    actual, unit = _content_length(data_dir, path, expected)
    if actual != needed:
        raise files.refuse(data_dir, f"{path} holds {actual} {unit}; its header ({what}) "
                                     f"needs {needed}")


def check_images(data_dir: str, path: str) -> int:
    """Checks an IDX image file's header and length; returns its image count."""
    header = _read_bytes(data_dir, path, IMAGES_HEADER, IMAGES_FORMAT)
    if len(header) < IMAGES_HEADER:
        raise files.refuse(data_dir, f"{path} holds {len(header)} bytes; {IMAGES_FORMAT}")
    magic, count, rows, cols = struct.unpack(">IIII", header)
    if magic != IMAGES_MAGIC:
        raise files.refuse(data_dir, f"{path} starts with magic 0x{magic:08x}; {IMAGES_FORMAT}")
    if (rows, cols) != (ROWS, COLS):
        raise files.refuse(data_dir, f"{path} holds {rows}x{cols} images; MNIST images are "
                                     f"{ROWS}x{COLS}")
    if count == 0:
        raise files.refuse(data_dir, f"{path} holds no images")
    _check_length(data_dir, path, IMAGES_HEADER + count * rows * cols,
                  f"{count} images of {rows}x{cols}", IMAGES_FORMAT)
    return count


def check_labels(data_dir: str, path: str) -> int:
    """Checks an IDX label file's header, length and labels (the file is small); returns its
    label count."""
    content = _read_bytes(data_dir, path, None, LABELS_FORMAT)
    if len(content) < LABELS_HEADER:
        raise files.refuse(data_dir, f"{path} holds {len(content)} bytes; {LABELS_FORMAT}")
    magic, count = struct.unpack(">II", content[:LABELS_HEADER])
    if magic != LABELS_MAGIC:
        raise files.refuse(data_dir, f"{path} starts with magic 0x{magic:08x}; {LABELS_FORMAT}")
    if count == 0:
        raise files.refuse(data_dir, f"{path} holds no labels")
    if len(content) != LABELS_HEADER + count:
        unit = "bytes uncompressed" if _is_gzip(path) else "bytes"
        raise files.refuse(data_dir, f"{path} holds {len(content)} {unit}; its header "
                                     f"({count} labels) needs {LABELS_HEADER + count}")
    files.check_labels(data_dir, path, np.frombuffer(content, np.uint8, offset=LABELS_HEADER),
                       NUM_CLASSES)
    return count


def check_files(data_dir: str) -> dict[str, tuple[str, str, int]]:
    """Every file is there with a valid header, length and labels; images and labels pair up.

    Returns, per split, (images path, labels path, example count)."""
    found = {}
    for split, (images_name, labels_name) in SPLITS.items():
        images_path = find_file(data_dir, images_name)
        labels_path = find_file(data_dir, labels_name)
        num_images = check_images(data_dir, images_path)
        num_labels = check_labels(data_dir, labels_path)
        if num_images != num_labels:
            raise files.refuse(data_dir, f"{images_path} holds {num_images} images but "
                                         f"{labels_path} holds {num_labels} labels; each image "
                                         "needs one label")
        found[split] = (images_path, labels_path, num_images)
    return found


def _records(path: str, record_bytes: int, header_bytes: int) -> tf.data.Dataset:
    return tf.data.FixedLengthRecordDataset(path, record_bytes, header_bytes=header_bytes,
                                            compression_type="GZIP" if _is_gzip(path) else "")


def read_split(images_path: str, labels_path: str, count: int):
    """Images uint8 [N, 28, 28, 1] and labels int32 [N] of one checked split, with tf.data."""
    images = _records(images_path, ROWS * COLS, IMAGES_HEADER).batch(10000).map(
        lambda r: tf.reshape(tf.io.decode_raw(r, tf.uint8), [-1, ROWS, COLS, 1]))
    labels = _records(labels_path, count, LABELS_HEADER).map(  # one record: every label
        lambda r: tf.cast(tf.io.decode_raw(r, tf.uint8), tf.int32))
    return (np.concatenate([batch.numpy() for batch in images]),
            next(iter(labels)).numpy())


def prepare(images: tf.Tensor) -> tf.Tensor:
    """uint8 [B, 28, 28, 1] -> float32 x / 255 in [0, 1]."""
    return tf.cast(images, tf.float32) / 255.0


def load(data_dir: str) -> InMemoryDataset:
    """Checks the files (as validation does, so a direct call is safe too), then reads them."""
    found = check_files(data_dir)
    train_x, train_y = read_split(*found["train"])
    eval_x, eval_y = read_split(*found["eval"])
    return InMemoryDataset("mnist", train_x, train_y, eval_x, eval_y, NUM_CLASSES,
                           prepare=prepare)
