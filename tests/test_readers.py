"""CIFAR-10 binary and MNIST IDX readers on small generated files: decoding, preprocessing,
augmentation, bad files refused before building, and short training runs."""

import gzip
import os
import re

import numpy as np
import pytest
import tensorflow as tf

import mgloop
from mgloop import data
from mgloop.data import augment, base, cifar10
from tests import dataset_files, helpers, tolerance
from tests.test_bad_input import nothing_built  # noqa: F401  (a fixture)


@pytest.fixture
def cifar_dir(tmp_path):
    directory = tmp_path / "cifar"
    return str(directory), dataset_files.write_cifar10(directory)


def stack(batches):
    xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in batches])
    return np.concatenate(xs), np.concatenate(ys)


# CIFAR-10 ------------------------------------------------------------------------------------

def test_cifar10_records_decode_to_hwc_images_and_labels(cifar_dir):
    directory, (train_x, train_y, eval_x, eval_y) = cifar_dir
    dataset = data.load("cifar10", seed=0, data_dir=directory)
    assert dataset.train_x.dtype == np.uint8 and dataset.input_shape == (32, 32, 3)
    np.testing.assert_array_equal(dataset.train_x, train_x)  # all five files, in order
    np.testing.assert_array_equal(dataset.train_y, train_y)
    np.testing.assert_array_equal(dataset.eval_x, eval_x)
    np.testing.assert_array_equal(dataset.eval_y, eval_y)
    assert dataset.num_classes == 10


def test_cifar10_plane_layout_by_hand(tmp_path):
    """A record's pixel bytes are the R plane, then G, then B, each row-major."""
    directory = tmp_path / "cifar"
    dataset_files.write_cifar10(directory)
    record = np.zeros(3073, np.uint8)
    record[0] = 7
    record[1 + 0 * 1024 + 1 * 32 + 2] = 11  # R at row 1, col 2
    record[1 + 1 * 1024 + 31 * 32 + 0] = 22  # G at row 31, col 0
    record[1 + 2 * 1024 + 0 * 32 + 31] = 33  # B at row 0, col 31
    (directory / "test_batch.bin").write_bytes(record.tobytes())
    image = data.load("cifar10", 0, str(directory)).eval_x[0]
    expected = np.zeros((32, 32, 3), np.uint8)
    expected[1, 2, 0], expected[31, 0, 1], expected[0, 31, 2] = 11, 22, 33
    np.testing.assert_array_equal(image, expected)


def test_cifar10_inputs_subtract_the_training_channel_mean(cifar_dir):
    directory, (train_x, _, eval_x, eval_y) = cifar_dir
    dataset = data.load("cifar10", 0, directory)
    mean = train_x.astype(np.float64).mean(axis=(0, 1, 2)) / 255  # per channel, train only
    x, y = stack(dataset.eval_batches(2))  # batches of 2, 2, 1: never augmented
    np.testing.assert_array_equal(y, eval_y)
    assert x.dtype == np.float32 and x.shape == (3, 32, 32, 3)
    # float32 x / 255 - m: the division (or a reciprocal and a product: 2 roundings), the
    # mean's rounding to float32 (u |m|; its float64 computation is exact integer sums and
    # one 2^-53 rounding, inside gamma's slack) and the subtraction: against the exact value
    # within gamma(3) (x / 255 + |m|). A mean off by one pixel value (1/255) is 3e4 u out.
    expected = eval_x / 255.0 - mean
    tolerance.assert_within([x], [expected],
                            [tolerance.gamma(3) * (eval_x / 255.0 + np.abs(mean))])


def test_cifar10_training_batches_are_augmented_pure_functions_of_seed_and_step(cifar_dir):
    directory, _ = cifar_dir
    dataset = data.load("cifar10", 0, directory)
    seed, batch = 5, 8
    straight = [(x.numpy(), y.numpy()) for x, y in dataset.train_batches(batch, seed).take(5)]
    indices = [i.numpy() for i in dataset.train_indices(batch, seed).take(5)]
    for step, ((x, y), idx) in enumerate(zip(straight, indices)):
        np.testing.assert_array_equal(y, dataset.train_y[idx])
        prepared = dataset.prepare(tf.constant(dataset.train_x[idx]))
        expected = cifar10.augment(prepared, base.augment_seed(seed, step))
        np.testing.assert_array_equal(x, expected.numpy())
        assert not np.allclose(x, prepared.numpy())  # augmentation changed the batch
    again = [x.numpy() for x, _ in dataset.train_batches(batch, seed).take(5)]
    resumed = [x.numpy() for x, _ in dataset.train_batches(batch, seed, start_step=3).take(2)]
    for actual, (expected, _) in zip(again + resumed, straight + straight[3:]):
        np.testing.assert_array_equal(actual, expected)


def test_augmentation_repeats_for_a_seed_and_step_and_changes_across_steps():
    images = tf.random.stateless_uniform([16, 32, 32, 3], seed=[1, 2])
    first = cifar10.augment(images, base.augment_seed(0, 7)).numpy()
    np.testing.assert_array_equal(first, cifar10.augment(images, base.augment_seed(0, 7)).numpy())
    for other in (base.augment_seed(0, 8), base.augment_seed(1, 7)):
        assert not np.array_equal(first, cifar10.augment(images, other).numpy())


def test_augmented_image_is_a_window_of_the_padded_image_maybe_mirrored():
    images = tf.random.stateless_uniform([64, 32, 32, 3], seed=[3, 4]).numpy()
    seed = base.augment_seed(2, 11)
    out = augment.random_crop_and_flip(tf.constant(images), seed, pad=4).numpy()
    offsets, flips = (t.numpy() for t in augment.crop_and_flip_params(seed, 64, 4))
    padded = np.pad(images, [(0, 0), (4, 4), (4, 4), (0, 0)])
    for b in range(64):
        matches = [(r, c, f) for r in range(9) for c in range(9) for f in (0, 1)
                   if np.array_equal(out[b], (lambda w: w[:, ::-1] if f else w)(
                       padded[b, r:r + 32, c:c + 32]))]
        assert matches == [(offsets[b, 0], offsets[b, 1], flips[b])]
    assert set(flips) == {0, 1} and len({tuple(o) for o in offsets}) > 20


# MNIST ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
def test_mnist_idx_files_decode_and_scale_to_unit_range(tmp_path, compress):
    train_x, train_y, eval_x, eval_y = dataset_files.write_mnist(tmp_path, compress=compress)
    dataset = data.load("mnist", 0, str(tmp_path))
    assert dataset.input_shape == (28, 28, 1)
    np.testing.assert_array_equal(dataset.train_x[..., 0], train_x)
    np.testing.assert_array_equal(dataset.train_y, train_y)
    np.testing.assert_array_equal(dataset.eval_y, eval_y)
    x, y = stack(dataset.eval_batches(3))
    np.testing.assert_array_equal(y, eval_y)
    assert x.dtype == np.float32 and x.min() >= 0.0 and x.max() <= 1.0
    # float32 x / 255: a division, or a reciprocal and a product (grappler may rewrite
    # it): within gamma(2) x / 255 of the exact value
    tolerance.assert_within([x[..., 0]], [eval_x / 255.0],
                            [tolerance.gamma(2) * eval_x / 255.0])
    (batch_x, batch_y), = [(x.numpy(), y.numpy()) for x, y in dataset.train_batches(4, 1).take(1)]
    idx = next(iter(dataset.train_indices(4, 1))).numpy()
    tolerance.assert_within([batch_x[..., 0]], [train_x[idx] / 255.0],  # no augmentation
                            [tolerance.gamma(2) * train_x[idx] / 255.0])
    np.testing.assert_array_equal(batch_y, train_y[idx])


def test_loading_directly_checks_the_files_too(tmp_path):
    """`data.load` without `Config.validated()` (e.g. from a script) still refuses a corrupt
    gzip stream with one line naming the file."""
    dataset_files.write_mnist(tmp_path, compress=True)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    content = bytearray(path.read_bytes())
    content[len(content) // 2:] = b"\x00" * (len(content) - len(content) // 2)
    path.write_bytes(bytes(content))
    with pytest.raises(mgloop.ConfigError, match=r"^--data_dir=.*t10k-images-idx3-ubyte.gz "
                                                 r"could not be read \(.*\); an IDX image file"):
        data.load("mnist", 0, str(tmp_path))


# Bad files: one line naming the file, before any device or variable --------------------------

def naming(directory, pattern):
    """The pattern of a one-line error about a file in `directory`."""
    return rf"^--data_dir={re.escape(directory)}: {re.escape(directory)}/{pattern}"


def truncate(path, drop=10):
    content = open(path, "rb").read()
    with open(path, "wb") as handle:
        handle.write(content[:-drop])


def set_byte(path, offset, value):
    content = bytearray(open(path, "rb").read())
    content[offset] = value
    with open(path, "wb") as handle:
        handle.write(bytes(content))


def gzip_rewrite(path, change):
    with gzip.open(path, "rb") as handle:
        content = bytearray(handle.read())
    change(content)
    with gzip.open(path, "wb") as handle:
        handle.write(bytes(content))


CIFAR_CASES = {
    "missing file": (lambda d: os.remove(os.path.join(d, "data_batch_3.bin")),
                     r"data_batch_3.bin is missing; --dataset=cifar10 reads data_batch_1.bin, "
                     r".*data_batch_5.bin and test_batch.bin"),
    "truncated file": (lambda d: truncate(os.path.join(d, "data_batch_3.bin")),
                       r"data_batch_3.bin has 12282 bytes; a CIFAR-10 batch file holds whole "
                       r"records of 3073 bytes"),
    "empty file": (lambda d: open(os.path.join(d, "test_batch.bin"), "wb").close(),
                   r"test_batch.bin has 0 bytes; a CIFAR-10 batch file holds whole records"),
    "label out of range": (lambda d: set_byte(os.path.join(d, "test_batch.bin"), 3073, 12),
                           r"test_batch.bin example 1 has label 12; labels must be 0..9"),
}


@pytest.mark.parametrize("case", sorted(CIFAR_CASES))
def test_bad_cifar10_file_is_refused_before_building(case, cifar_dir, logdir, nothing_built):
    directory, _ = cifar_dir
    spoil, pattern = CIFAR_CASES[case]
    spoil(directory)
    with pytest.raises(mgloop.ConfigError, match=naming(directory, pattern)) as error:
        mgloop.run(helpers.small_config(logdir, dataset="cifar10", data_dir=directory))
    assert "\n" not in str(error.value)


def images_path(d, split="train", gz=""):
    return os.path.join(d, dataset_files.MNIST_FILES[split][0] + gz)


def labels_path(d, split="train", gz=""):
    return os.path.join(d, dataset_files.MNIST_FILES[split][1] + gz)


MNIST_CASES = {
    "missing file": (False, lambda d: os.remove(labels_path(d, "eval")),
                     r"t10k-labels-idx1-ubyte \(or .gz\) is missing; --dataset=mnist reads"),
    "wrong image magic": (False, lambda d: set_byte(images_path(d), 3, 0x01),
                          r"train-images-idx3-ubyte starts with magic 0x00000801; an IDX image "
                          r"file starts with magic 0x00000803"),
    "wrong label magic": (True, lambda d: gzip_rewrite(labels_path(d, "eval", ".gz"),
                                                       lambda c: c.__setitem__(2, 9)),
                          r"t10k-labels-idx1-ubyte.gz starts with magic 0x00000901; an IDX "
                          r"label file starts with magic 0x00000801"),
    "truncated images": (False, lambda d: truncate(images_path(d)),
                         r"train-images-idx3-ubyte holds 4710 bytes; its header \(6 images of "
                         r"28x28\) needs 4720"),
    "truncated gzip stream": (True, lambda d: truncate(images_path(d, gz=".gz"), drop=100),
                              r"train-images-idx3-ubyte.gz could not be read \(Compressed file "
                              r"ended .*\); an IDX image file starts with magic 0x00000803"),
    "header count too big": (True, lambda d: gzip_rewrite(images_path(d, "eval", ".gz"),
                                                          lambda c: c.__setitem__(7, 5)),
                             r"t10k-images-idx3-ubyte.gz holds 3152 bytes uncompressed; its "
                             r"header \(5 images of 28x28\) needs 3936"),
    "label count differs": (False, lambda d: open(labels_path(d), "wb").write(
                                dataset_files.idx_labels(np.zeros(5))),
                            r"train-images-idx3-ubyte holds 6 images but .*train-labels-idx1-"
                            r"ubyte holds 5 labels; each image needs one label"),
    "wrong image size": (False, lambda d: open(images_path(d), "wb").write(
                             dataset_files.idx_images(np.zeros((6, 32, 32)))),
                         r"train-images-idx3-ubyte holds 32x32 images; MNIST images are 28x28"),
    "label out of range": (False, lambda d: set_byte(labels_path(d), 8 + 2, 10),
                           r"train-labels-idx1-ubyte example 2 has label 10; labels must be "
                           r"0..9"),
}


@pytest.mark.parametrize("case", sorted(MNIST_CASES))
def test_bad_mnist_file_is_refused_before_building(case, tmp_path, logdir, nothing_built):
    compress, spoil, pattern = MNIST_CASES[case]
    directory = str(tmp_path / "mnist")
    dataset_files.write_mnist(directory, compress=compress)
    spoil(directory)
    with pytest.raises(mgloop.ConfigError, match=naming(directory, pattern)) as error:
        mgloop.run(helpers.small_config(logdir, dataset="mnist", data_dir=directory))
    assert "\n" not in str(error.value)


def test_data_dir_settings_are_checked(tmp_path, logdir, nothing_built):
    cases = [
        (dict(dataset="cifar10"), r"^--dataset=cifar10 reads its files from --data_dir; set "
                                  r"--data_dir to the folder holding data_batch_1.bin"),
        (dict(dataset="mnist", data_dir=str(tmp_path / "absent")),
         r"^--data_dir=.*absent is not a directory; give the folder holding the four MNIST"),
        (dict(dataset="synthetic", data_dir=str(tmp_path)),
         r"^--data_dir=.* is set but --dataset=synthetic reads no files; drop --data_dir or use "
         r"--dataset=cifar10 or mnist"),
    ]
    for overrides, pattern in cases:
        with pytest.raises(mgloop.ConfigError, match=pattern) as error:
            mgloop.run(helpers.small_config(logdir, **overrides))
        assert "\n" not in str(error.value)


# The whole path ------------------------------------------------------------------------------

def train(tmp_path, name, dataset, directory, **overrides):
    settings = dict(devices="cpu:2", aggregation="ring", model="cnn", dataset=dataset,
                    data_dir=directory, global_batch_size=16, learning_rate=0.02,
                    train_steps=4, steps_per_loop=4, checkpoint_every=0)
    settings.update(overrides)
    return mgloop.run(helpers.small_config(str(tmp_path / name), **settings))


def test_cifar10_run_learns_and_repeats_under_deterministic(tmp_path):
    directory = str(tmp_path / "cifar")
    dataset_files.write_cifar10(directory, train_counts=(40,) * 5, eval_count=40,
                                learnable=True, num_classes=2)
    first = train(tmp_path, "a", "cifar10", directory, train_steps=40, steps_per_loop=20)
    assert first["final_step"] == 40 and first["eval_accuracy"] > 0.8
    second = train(tmp_path, "b", "cifar10", directory, train_steps=40, steps_per_loop=20)
    assert second["final_train_loss"] == first["final_train_loss"]
    assert second["eval_loss"] == first["eval_loss"]


def test_mnist_run_learns_from_gzip_files(tmp_path):
    directory = str(tmp_path / "mnist")
    dataset_files.write_mnist(directory, train_count=200, eval_count=40, compress=True,
                              learnable=True, num_classes=2)
    summary = train(tmp_path, "m", "mnist", directory, train_steps=40, steps_per_loop=20)
    assert summary["final_step"] == 40 and summary["eval_accuracy"] > 0.8
