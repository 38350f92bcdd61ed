"""Data that installs with the package: the 8x8 digits (bundled in mgloop/data), its split and values, refusals, and a short run that learns; the standard
library's modules as byte-level LM text; --partition=dirichlet against a numpy model of
itself, tower slices from their client's part, resume, iid unchanged, refusals."""

from __future__ import annotations

import gzip
import json
import os
import sysconfig

import numpy as np
import pytest
import tensorflow as tf

from mgloop import data
from mgloop import launch
from mgloop.cluster import workers as cluster
from mgloop.data import batch_split
from mgloop.runs import experiment, run_inputs
from mgloop.runs.config import Config
from mgloop.data import base, digits, epochs, inputs, partition, python_text
from mgloop.errors import ConfigError
from tests import helpers

# Digits ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits_data():
    return data.load("digits", seed=0)


def _file_rows() -> np.ndarray:
    """The CSV as plain Python reads it, independently of digits.read."""
    with gzip.open(digits.find_file(), "rt") as handle:
        return np.array([[int(v) for v in line.split(",")] for line in handle if line.strip()])


def test_digits_has_1797_images_of_10_classes_split_1500_297_in_file_order(digits_data):
    rows = _file_rows()
    assert rows.shape == (1797, 65)
    d = digits_data
    assert (len(d.train_y), len(d.eval_y)) == (1500, 297) and d.num_classes == 10
    assert d.input_shape == (8, 8, 1) and d.train_x.dtype == np.uint8
    np.testing.assert_array_equal(np.concatenate([d.train_x, d.eval_x]).reshape(1797, 64),
                                  rows[:, :64])
    np.testing.assert_array_equal(np.concatenate([d.train_y, d.eval_y]), rows[:, 64])
    assert d.train_x.max() == 16 and d.train_x.min() == 0
    # the documented class counts of the eval split; every class in both splits
    np.testing.assert_array_equal(np.bincount(d.eval_y, minlength=10),
                                  [27, 31, 27, 30, 33, 30, 30, 30, 28, 31])
    assert np.bincount(d.train_y, minlength=10).min() >= 146


def test_digits_split_does_not_depend_on_the_seed(digits_data):
    other = data.load("digits", seed=5)
    np.testing.assert_array_equal(other.train_x, digits_data.train_x)
    np.testing.assert_array_equal(other.eval_y, digits_data.eval_y)


def test_digits_inputs_are_pixels_over_16(digits_data):
    x, _ = next(iter(digits_data.eval_batches(297)))
    assert x.dtype.name == "float32" and tuple(x.shape) == (297, 8, 8, 1)
    np.testing.assert_array_equal(x.numpy(), digits_data.eval_x.astype(np.float32) / 16)


def test_digits_bad_or_missing_file_is_refused_in_one_line(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"^--data_dir=.* is set but --dataset=digits reads "
                                          r"no files"):
        data.check("digits", str(tmp_path))
    bad = tmp_path / "digits.csv.gz"
    cases = [(b"not gzip at all", r"could not be read as gzip-compressed CSV"),
             (gzip.compress(b"1,2,3\n4,5,6\n"), r"holds 2 rows of 3 values; digits has 1797"),
             (gzip.compress(("0," * 64 + "3\n").encode() * 1796 + ("17," * 64 + "3\n").encode()),
              r"holds pixel values 0..17"),
             (gzip.compress(("0," * 64 + "3\n").encode() * 1796 + ("0," * 64 + "10\n").encode()),
              r"row 1796 has label 10")]
    monkeypatch.setattr(digits, "find_file", lambda: str(bad))
    for content, message in cases:
        bad.write_bytes(content)
        with pytest.raises(ConfigError, match=message) as error:
            data.check("digits", None)
        assert str(bad) in str(error.value) and "reinstall mgloop" in str(error.value)
        assert "\n" not in str(error.value)
    monkeypatch.undo()
    monkeypatch.setattr(digits, "FILE", str(tmp_path / "gone.csv.gz"))
    with pytest.raises(ConfigError, match=r"^--dataset=digits: .*gone.csv.gz is missing from "
                                          r"the mgloop package; reinstall mgloop"):
        data.check("digits", None)


def test_digits_refuses_minigooglenet_and_builds_mlp_cnn_resnet20(tmp_path, digits_data):
    with pytest.raises(ConfigError, match=r"^--model=minigooglenet cannot train on "
                                          r"--dataset=digits: .* at least 31x31"):
        Config(dataset="digits", model="minigooglenet", devices="cpu:1",
               logdir=str(tmp_path / "run")).validated()
    from mgloop import models
    for name in ("mlp", "cnn", "resnet20"):
        model = models.get(name)(digits_data.input_shape, digits_data.num_classes)
        assert model.output_shape == (None, 10)


def test_a_short_mlp_run_on_digits_learns(logdir):
    """30 steps of 64 examples (1.3 epochs) take the mean loss of a loop from about ln 10
    to under half of it, and the eval accuracy well above chance (0.1)."""
    config = helpers.small_config(logdir, dataset="digits", devices="cpu:2",
                                  global_batch_size=64, train_steps=30, steps_per_loop=5)
    result = experiment.run(config)
    _, losses = result.history.of("train/loss")
    assert len(losses) == 6 and losses[0] > 1.5 and losses[-1] < 0.5 * losses[0], losses
    assert result["eval_accuracy"] > 0.5


# Python's standard library as text -----------------------------------------------------------


@pytest.fixture(scope="module")
def stdlib_stream():
    return python_text.tokens()


def test_python_text_is_the_stdlib_top_level_modules_capped_at_3_mib(stdlib_stream):
    """An independent reading of the documented rule gives the same bytes."""
    folder = sysconfig.get_paths()["stdlib"]
    expected = b""
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".py") and os.path.isfile(path):
            content = open(path, "rb").read()
            try:
                content.decode("utf-8")
            except UnicodeDecodeError:
                continue
            expected += content
    expected = expected[:3 * 2**20]
    assert stdlib_stream.tobytes() == expected
    assert len(expected) == 3 * 2**20  # CPython's top-level modules hold more than the cap
    np.testing.assert_array_equal(python_text.tokens(), stdlib_stream)  # deterministic


def test_python_text_windows_and_split_are_text_datasets(stdlib_stream):
    d = data.load("python_text", seed=0, sequence_length=64)
    again = data.load("python_text", seed=9, sequence_length=64)
    count = (len(stdlib_stream) - 1) // 64
    held_out = count // 10
    assert (len(d.train_y), len(d.eval_y)) == (count - held_out, held_out)
    assert d.num_classes == 256 and d.input_shape == (64,) and d.name == "python_text"
    np.testing.assert_array_equal(np.concatenate([d.train_x, d.eval_x]).reshape(-1),
                                  stdlib_stream[:count * 64])
    np.testing.assert_array_equal(np.concatenate([d.train_y, d.eval_y]).reshape(-1),
                                  stdlib_stream[1:count * 64 + 1])
    np.testing.assert_array_equal(again.train_x, d.train_x)
    assert data.sequence_length_of(Config(dataset="python_text").data) == 64


def test_python_text_refusals(tmp_path):
    with pytest.raises(ConfigError, match=r"^--data_dir=.* is set but --dataset=python_text "
                                          r"reads no files"):
        data.check("python_text", str(tmp_path))
    with pytest.raises(ConfigError, match=r"^--dataset=python_text reads the standard "
                                          r"library's .py modules, but .* holds none"):
        python_text.check_files(str(tmp_path))
    with pytest.raises(ConfigError, match=r"--dataset=digits has no sequences; drop it or use "
                                          r"--dataset=text or python_text"):
        Config(dataset="digits", sequence_length=8, devices="cpu:1",
               logdir=str(tmp_path / "run")).validated()


def test_two_steps_of_a_tiny_transformer_on_python_text(logdir):
    config = helpers.small_config(
        logdir, dataset="python_text", model="transformer_lm", lm_layers=1, lm_width=16,
        lm_heads=2, sequence_length=64, global_batch_size=64, devices="cpu:1",
        train_steps=2, steps_per_loop=2, optimizer="adam", learning_rate=0.003)
    result = experiment.run(config)
    assert result["final_step"] == 2 and np.isfinite(result["final_train_loss"])
    assert result["eval_perplexity"] < 256  # below uniform over the bytes after 2 steps


# --partition=dirichlet -----------------------------------------------------------------------

# hand-made labels: 80 examples of 3 classes (40, 30 and 10), interleaved
LABELS = np.array([0, 1, 0, 2, 1, 0, 0, 1] * 10, np.int32)
COUNTS = np.array([40, 30, 10])


def numpy_model(labels, num_classes, clients, alpha, seed):
    """The module docstring's recipe, written out again: class by class, a permutation of
    the class's indices, then its proportions; cut at floor(m * cumulative proportion)."""
    rng = np.random.default_rng(seed)
    parts = [set() for _ in range(clients)]
    for c in range(num_classes):
        members = list(rng.permutation([i for i, y in enumerate(labels) if y == c]))
        p = rng.dirichlet([alpha] * clients)
        start = 0
        for i in range(clients):
            end = len(members) if i == clients - 1 else int(np.floor(len(members) * sum(p[:i + 1])))
            parts[i].update(members[start:end])
            start = end
    return [sorted(p) for p in parts]


@pytest.mark.parametrize("clients,alpha,seed", [(4, 0.5, 7), (3, 5.0, 0), (2, 0.05, 11)])
def test_dirichlet_parts_equal_the_numpy_model(clients, alpha, seed):
    parts = partition.dirichlet_parts(LABELS, 3, clients, alpha, seed)
    expected = numpy_model(LABELS, 3, clients, alpha, seed)
    assert [p.tolist() for p in parts] == expected
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(LABELS)))  # a partition
    counts = partition.class_counts(LABELS, parts, 3)
    assert counts.tolist() == [np.bincount(LABELS[e], minlength=3).tolist() for e in expected]
    np.testing.assert_array_equal(counts.sum(0), COUNTS)


def test_dirichlet_large_alpha_is_near_uniform_small_alpha_concentrated():
    labels = np.repeat(np.arange(5), 400)  # 5 classes of m = 400
    n = 4
    # alpha = 1e4: each p_i has mean 1/n and sd sqrt((1/n)(1 - 1/n) / (n alpha + 1)) < 0.0022,
    # so within 6 sd the count m p_i, floored at both cuts, is m/n +- (6 * 0.0022 m + 1)
    uniform = partition.class_counts(labels, partition.dirichlet_parts(labels, 5, n, 1e4, 0), 5)
    assert np.abs(uniform - 100).max() <= 6 * 0.0022 * 400 + 1
    # alpha = 1e-3: P(a second proportion above 0.02) is O(n^2 alpha), so every class sits
    # (almost) whole with one client
    concentrated = partition.class_counts(
        labels, partition.dirichlet_parts(labels, 5, n, 1e-3, 0), 5)
    assert (concentrated.max(0) >= 0.98 * 400).all()


def indexed_dataset(labels, num_eval=4):
    """x = the example's index (float32 [N, 1]), so a batch says which examples it holds."""
    n = len(labels)
    return base.InMemoryDataset("hand_made", np.arange(n, dtype=np.float32)[:, None], labels,
                                np.zeros((num_eval, 1), np.float32),
                                np.zeros(num_eval, np.int32), 3)


def partitioned_input(tmp_path, **settings):
    """Validated (under TF_CONFIG, if set: then this worker's input)."""
    config = Config(**{**dict(devices="cpu:4", global_batch_size=8, seed=5,
                              partition="dirichlet:alpha=0.5", drop_remainder=False,
                              logdir=str(tmp_path / "run")), **settings}).validated()
    made = inputs.InMemoryInput(indexed_dataset(LABELS), config.data,
                                run_inputs.reading(config, cluster.from_environment()))
    return made, config


def take(made, start, steps):
    return [(x.numpy()[:, 0].astype(int), y.numpy())
            for x, y in made.train_batches(start).take(steps)]


@pytest.mark.parametrize("settings,client_of_tower", [
    (dict(), [0, 1, 2, 3]),                                       # clients: the 4 towers
    (dict(nodes=2), [0, 0, 1, 1]),                                # the 2 nodes
    (dict(nodes=2, method_at="towers"), [0, 1, 2, 3]),            # the method sees towers
    (dict(accumulation_steps=2), [0, 1, 2, 3])])
def test_each_towers_slice_comes_from_its_clients_part(tmp_path, settings, client_of_tower):
    made, config = partitioned_input(tmp_path, **settings)
    clients = max(client_of_tower) + 1
    parts = partition.dirichlet_parts(LABELS, 3, clients, 0.5, 5)
    assert [p.tolist() for p in made.parts] == [p.tolist() for p in parts]
    for x, y in take(made, 0, 12):
        np.testing.assert_array_equal(y, LABELS[x])
        shards = batch_split.tower_split(tf.constant(x), 4, config.accumulation_steps)
        for tower, shard in enumerate(shards):
            assert set(shard.numpy().tolist()) <= set(parts[client_of_tower[tower]].tolist())
    # each client's own epochs: over 1 + its part's size / shard steps, every example of its
    # part appears (a pass over its part), with drop_remainder=false the epochs running on
    shard = 8 // clients
    for client, part in enumerate(parts):
        steps = -(-len(part) // shard)
        seen = np.concatenate([x.reshape(-1, clients, shard)[:, client].ravel()
                               for x, _ in take(made, 0, steps)])
        assert set(seen[:len(part)].tolist()) == set(part.tolist())


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_partitioned_batch_s_is_the_same_when_started_at_step_s(tmp_path, drop_remainder):
    made, _ = partitioned_input(tmp_path, drop_remainder=drop_remainder, devices="cpu:2",
                                partition="dirichlet:alpha=10")
    whole = take(made, 0, 30)
    for start in (1, 7, 23):
        for (x, y), (x0, y0) in zip(take(made, start, 5), whole[start:start + 5]):
            np.testing.assert_array_equal(x, x0)
            np.testing.assert_array_equal(y, y0)
    again, _ = partitioned_input(tmp_path, drop_remainder=drop_remainder, devices="cpu:2",
                                 partition="dirichlet:alpha=10")
    assert all((a[0] == b[0]).all() for a, b in zip(take(again, 0, 30), whole))


@pytest.mark.parametrize("settings,clients", [
    (dict(), 2),                                      # each worker a node: node w's shard
    (dict(method_at="towers"), 4),                    # every tower a client
    (dict(accumulation_steps=2, drop_remainder=True), 2)])
def test_worker_ws_towers_read_what_node_ws_towers_read_in_one_process(
        tmp_path, monkeypatch, settings, clients):
    """2 workers of 2 towers against --nodes=2 of 4 towers in one process: the same parts,
    and global tower 2w + t of worker w gets, step by step, the examples tower 2w + t gets
    in one process (with accumulation, of every micro-batch); only the chief writes
    partition.json."""
    one, config = partitioned_input(tmp_path, nodes=2, **settings)
    assert len(one.parts) == clients
    whole = take(one, 0, 12)
    micro = config.accumulation_steps
    for w in range(2):
        monkeypatch.setenv("TF_CONFIG", launch.tf_config(["127.0.0.1:1", "127.0.0.1:2"], w))
        logdir = tmp_path / f"worker{w}"
        made, _ = partitioned_input(tmp_path, devices="cpu:2", logdir=str(logdir), **settings)
        assert [p.tolist() for p in made.parts] == [p.tolist() for p in one.parts]
        assert os.path.exists(logdir / partition.FILENAME) == (w == 0)
        for (x, y), (x1, y1) in zip(take(made, 0, 12), whole):
            np.testing.assert_array_equal(y, LABELS[x])
            mine = batch_split.tower_split(tf.constant(x), 2, micro)
            theirs = batch_split.tower_split(tf.constant(x1), 4, micro)
            for t in range(2):
                np.testing.assert_array_equal(mine[t], theirs[2 * w + t])
    monkeypatch.delenv("TF_CONFIG")


def test_iid_is_the_unpartitioned_stream_bit_for_bit(tmp_path):
    dataset = indexed_dataset(LABELS)
    for drop in (True, False):
        config = Config(devices="cpu:4", global_batch_size=12, seed=5, drop_remainder=drop,
                        logdir=str(tmp_path / f"run{drop}")).validated()
        made = inputs.InMemoryInput(dataset, config.data, run_inputs.reading(config))
        assert made.parts is None and config.partition == "iid"
        got = [x.numpy() for x, _ in made.train_batches(3).take(10)]
        want = [x.numpy() for x, _ in epochs.train_batches(dataset, 12, 5, 3, drop).take(10)]
        np.testing.assert_array_equal(got, want)
        if not drop:  # the epochs' own permutations argsort(uniform(seed=[5, e]))
            keys = [tf.random.stateless_uniform([80], seed=[5, e]) for e in range(2)]
            stream = np.concatenate([tf.argsort(k, stable=True).numpy() for k in keys])
            np.testing.assert_array_equal(np.concatenate(got)[:, 0], stream[36:156])


def test_the_partition_is_logged_and_written_to_partition_json(tmp_path, caplog):
    made, config = partitioned_input(tmp_path)
    with open(os.path.join(config.logdir, "partition.json")) as handle:
        report = json.load(handle)
    counts = partition.class_counts(LABELS, made.parts, 3)
    assert report["class_counts"] == counts.tolist() and report["unit"] == "towers"
    assert report["examples"] == [len(p) for p in made.parts] and report["clients"] == 4


def test_partition_refusals(tmp_path, text_folder):
    base_settings = dict(devices="cpu:4", logdir=str(tmp_path / "run"))
    for spec, message in [
            ("dirichlet", r"dirichlet takes one option, alpha=A"),
            ("dirichlet:beta=1", r"dirichlet takes one option, alpha=A"),
            ("dirichlet:alpha=0", r"alpha=0.0 is out of range: must be a finite number > 0"),
            ("dirichlet:alpha=nan", r"alpha=nan is out of range"),
            ("dirichlet:alpha=x", r"alpha='x' is not a number"),
            ("iid:alpha=1", r"is not one of: iid, dirichlet:alpha=A"),
            ("shards", r"^--partition='shards' is not one of: iid, dirichlet:alpha=A")]:
        with pytest.raises(ConfigError, match=message):
            Config(partition=spec, **base_settings).validated()
    for settings in (dict(dataset="python_text"), dict(dataset="text", data_dir=text_folder)):
        with pytest.raises(ConfigError, match=r"language-model dataset .* no class label per "
                                              r"example\), so its examples cannot be dealt"):
            Config(partition="dirichlet:alpha=1", model="transformer_lm", **base_settings,
                   **settings).validated()
    data.register("partition_test_stream", lambda data_dir, context: None)
    with pytest.raises(ConfigError, match=r"--dataset=partition_test_stream: a --plugin "
                                          r"dataset is read as a tf.data stream"):
        Config(partition="dirichlet:alpha=1", dataset="partition_test_stream",
               data_dir=str(tmp_path), **base_settings).validated()
    config = Config(partition="dirichlet:alpha=1", **base_settings).validated()
    stream = tf.data.Dataset.from_tensor_slices((np.zeros((8, 1), np.float32),
                                                 np.zeros(8, np.int32)))
    with pytest.raises(ConfigError, match=r"^--partition=dirichlet:alpha=1 with train_data "
                                          r"given as .*: only an in-memory labelled dataset"):
        data.as_input(stream, config.data, run_inputs.reading(config), "train_data")
    # tiny parts: 8 clients of 80 examples at a small alpha leave one empty; with
    # drop_remainder=true a part smaller than its shard of 16 / 4 = 4
    with pytest.raises(ConfigError, match=r"^--partition=dirichlet:alpha=0.01 with --seed=5 "
                                          r"gives client \d of the 4 towers no training "
                                          r"examples; use a larger alpha"):
        partitioned_input(tmp_path, partition="dirichlet:alpha=0.01")
    small = next(s for s in range(50) if 0 < min(map(len, partition.dirichlet_parts(
        LABELS, 3, 4, 0.5, s))) < 4)
    with pytest.raises(ConfigError, match=rf"--seed={small} gives client \d of the 4 towers "
                                          r"\d training examples, fewer than its shard of 4 "
                                          r"per step, so with --drop_remainder=true"):
        partitioned_input(tmp_path, seed=small, global_batch_size=16, drop_remainder=True)


@pytest.fixture
def text_folder(tmp_path):
    (tmp_path / "t.txt").write_text("some text " * 20)
    return str(tmp_path)


def test_a_partitioned_run_on_digits_trains(logdir):
    config = helpers.small_config(logdir, dataset="digits", devices="cpu:2", nodes=2,
                                  global_batch_size=64, train_steps=10, steps_per_loop=5,
                                  partition="dirichlet:alpha=0.3")
    result = experiment.run(config)
    with open(os.path.join(logdir, "partition.json")) as handle:
        report = json.load(handle)
    assert report["unit"] == "nodes" and sum(report["examples"]) == 1500
    assert np.isfinite(result["final_train_loss"]) and result["final_step"] == 10
