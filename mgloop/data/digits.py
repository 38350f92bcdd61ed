"""`digits`: the real 8x8 handwritten digits, bundled with mgloop (57 KB).

The UCI "Optical Recognition of Handwritten Digits" test set (Alpaydin and Kaynak,
1998; CC BY 4.0, attribution in DIGITS_NOTICE.txt beside this file): 1797 images of 10
classes, each 8x8 pixels of counts 0..16 (a 32x32 bitmap divided into 4x4 blocks, the
pixels set in each block counted). `digits.csv.gz` beside this module is the file as
scikit-learn distributes it (gzip-compressed CSV, one row per image, 64 integer pixel
values row-major, then the label 0..9), unchanged; it was read from scikit-learn's wheel
until scikit-learn was dropped as a dependency (Keras imports it whenever it is
installed: about half a second more for every process; experiments/startup.py).
It is read with numpy; `check_files` verifies it during `Config.validated()` and
refuses a missing or malformed file in one line that names it. No `--data_dir`: the file
comes with the package (a --data_dir is refused, as for synthetic).

Split (fixed, independent of --seed): the file's own order, its first 1500 images the
train split and its last 297 the eval split. The rows cycle roughly through the classes
(0, 1, .., 9, 0, 1, ..), so both splits hold every class: the eval split 27..33 images of
each (class counts 27 31 27 30 33 30 30 30 28 31 for 0..9), the train split 146..153.

Stored as uint8 [N, 8, 8, 1] (values 0..16); a batch becomes float32 inputs x / 16 in
[0, 1], an image shape that --model=mlp, cnn, big_mlp and resnet20 take (resnet20's two
stride-2 stages leave 2x2 maps); minigooglenet needs at least 31x31 and is refused.
"""

from __future__ import annotations

import gzip
import os
import zlib

import numpy as np
import tensorflow as tf

from mgloop.data.base import InMemoryDataset
from mgloop.errors import ConfigError

FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits.csv.gz")
NUM_EXAMPLES, NUM_TRAIN = 1797, 1500
ROWS = COLS = 8
MAX_PIXEL = 16
NUM_CLASSES = 10
INSTALL = "reinstall mgloop (pip install -e .): the file ships inside its package"
# What the models need that the 8x8 images cannot give (data.check_model refuses them).
UNFIT_MODELS = {"minigooglenet": "its two valid 3x3 stride-2 downsamplings and 7x7 average "
                                 "pool need images of at least 31x31, and digits are 8x8"}


def find_file() -> str:
    """The path of the bundled digits.csv.gz."""
    if not os.path.isfile(FILE):
        raise ConfigError(f"--dataset=digits: {FILE} is missing from the mgloop package; "
                          f"{INSTALL}")
    return FILE


def _refuse(path: str, message: str) -> ConfigError:
    return ConfigError(f"--dataset=digits: {path} {message}; {INSTALL}")


def read(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Checks and reads the file: images uint8 [1797, 8, 8, 1] and labels int32 [1797]."""
    try:
        with gzip.open(path, "rt", encoding="ascii") as handle:
            rows = np.loadtxt(handle, delimiter=",", dtype=np.int64, ndmin=2)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, ValueError) as error:
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise _refuse(path, f"could not be read as gzip-compressed CSV of integers ({detail})"
                      ) from None
    if rows.shape != (NUM_EXAMPLES, ROWS * COLS + 1):
        raise _refuse(path, f"holds {rows.shape[0]} rows of {rows.shape[1]} values; digits has "
                            f"{NUM_EXAMPLES} rows of {ROWS * COLS} pixels and a label")
    pixels, labels = rows[:, :-1], rows[:, -1]
    if pixels.min() < 0 or pixels.max() > MAX_PIXEL:
        raise _refuse(path, f"holds pixel values {pixels.min()}..{pixels.max()}; they must be "
                            f"0..{MAX_PIXEL}")
    bad = np.flatnonzero((labels < 0) | (labels >= NUM_CLASSES))
    if bad.size:
        raise _refuse(path, f"row {int(bad[0])} has label {int(labels[bad[0]])}; labels must be "
                            f"0..{NUM_CLASSES - 1}")
    return (pixels.astype(np.uint8).reshape(NUM_EXAMPLES, ROWS, COLS, 1),
            labels.astype(np.int32))


def check_files() -> None:
    """Refuses a missing or malformed digits file (validation; about 10 ms)."""
    read(find_file())


def prepare(images: tf.Tensor) -> tf.Tensor:
    """uint8 [B, 8, 8, 1] of 0..16 -> float32 x / 16 in [0, 1]."""
    return tf.cast(images, tf.float32) / float(MAX_PIXEL)


def load() -> InMemoryDataset:
    """Reads (and checks) the file; the split of the module docstring."""
    images, labels = read(find_file())
    return InMemoryDataset("digits", images[:NUM_TRAIN], labels[:NUM_TRAIN],
                           images[NUM_TRAIN:], labels[NUM_TRAIN:], NUM_CLASSES,
                           prepare=prepare)
