"""Writers of small dataset files in the real formats (CIFAR-10 binary, MNIST IDX), for tests.

They write with numpy and struct from the test's own HWC arrays, independently of
mgloop's readers, so a reader that got the layout wrong would not match.
"""

from __future__ import annotations

import gzip
import os
import struct

import numpy as np

CIFAR_TRAIN_FILES = [f"data_batch_{i}.bin" for i in range(1, 6)]
CIFAR_EVAL_FILE = "test_batch.bin"
MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               "eval": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def cifar_records(images_hwc: np.ndarray, labels: np.ndarray) -> bytes:
    """Records of 1 label byte + the R, G and B 32x32 planes, each row-major."""
    planes = images_hwc.transpose(0, 3, 1, 2).reshape(len(images_hwc), -1)  # CHW
    return np.concatenate([labels[:, None].astype(np.uint8), planes], axis=1).tobytes()


def learnable_images(rng, labels: np.ndarray, shape, num_classes: int) -> np.ndarray:
    """uint8 images whose brightness grows with the label (40 to 200), plus noise in
    -30..30: a task a small CNN learns in a few dozen steps."""
    step = 160 // max(1, num_classes - 1)
    base = (labels.astype(np.float64) * step + 40).reshape(-1, *([1] * len(shape)))
    noise = rng.integers(-30, 31, size=(len(labels), *shape))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def write_cifar10(directory, train_counts=(3, 2, 4, 1, 2), eval_count=3, seed=0,
                  learnable=False, num_classes=10):
    """Writes the five training files and the test file; returns (train_x, train_y,
    eval_x, eval_y) as uint8 HWC images and int labels, in file order."""
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)

    def make(count):
        labels = rng.integers(num_classes, size=count).astype(np.uint8)
        if learnable:
            return learnable_images(rng, labels, (32, 32, 3), num_classes), labels
        return rng.integers(0, 256, size=(count, 32, 32, 3), dtype=np.uint8), labels

    train = [make(count) for count in train_counts]
    for name, (images, labels) in zip(CIFAR_TRAIN_FILES, train):
        with open(os.path.join(directory, name), "wb") as handle:
            handle.write(cifar_records(images, labels))
    eval_x, eval_y = make(eval_count)
    with open(os.path.join(directory, CIFAR_EVAL_FILE), "wb") as handle:
        handle.write(cifar_records(eval_x, eval_y))
    return (np.concatenate([x for x, _ in train]), np.concatenate([y for _, y in train]),
            eval_x, eval_y)


def idx_images(images: np.ndarray) -> bytes:
    count, rows, cols = images.shape
    return struct.pack(">IIII", 0x00000803, count, rows, cols) + images.astype(np.uint8).tobytes()


def idx_labels(labels: np.ndarray) -> bytes:
    return struct.pack(">II", 0x00000801, len(labels)) + labels.astype(np.uint8).tobytes()


def write_file(path, content: bytes, compress: bool) -> str:
    if compress:
        path = str(path) + ".gz"
        with gzip.open(path, "wb") as handle:
            handle.write(content)
    else:
        with open(path, "wb") as handle:
            handle.write(content)
    return str(path)


def write_mnist(directory, train_count=6, eval_count=4, compress=False, seed=0,
                learnable=False, num_classes=10):
    """Writes the four IDX files (gzipped if `compress`); returns (train_x, train_y,
    eval_x, eval_y) as uint8 [N, 28, 28] images and int labels."""
    rng = np.random.default_rng(seed)
    os.makedirs(directory, exist_ok=True)
    arrays = []
    for split, count in (("train", train_count), ("eval", eval_count)):
        labels = rng.integers(num_classes, size=count).astype(np.uint8)
        images = (learnable_images(rng, labels, (28, 28), num_classes) if learnable
                  else rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8))
        images_name, labels_name = MNIST_FILES[split]
        write_file(os.path.join(directory, images_name), idx_images(images), compress)
        write_file(os.path.join(directory, labels_name), idx_labels(labels), compress)
        arrays += [images, labels]
    return tuple(arrays)
