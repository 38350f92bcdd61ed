"""Input staging: every example once, in order, in every mode; the same losses; input wait.

The training examples here encode their own index (x[i, 0, 0, 0] = i), and a
recording wrapper around `per_tower.tower_pass` reads back which examples each
tower received at each step, so the tests observe what the towers consumed.
"""

import collections
import dataclasses
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from mgloop.step import per_tower
from mgloop.data import InMemoryDataset, epochs
from tests import helpers

SEED = 3
GLOBAL_BATCH = 8
NUM_TRAIN = 44  # 5 full batches of 8 per epoch; 4 examples left over (dropped by default)


def index_dataset(num_train=NUM_TRAIN, num_eval=8) -> InMemoryDataset:
    """Examples whose first input value is their own index; labels i mod 10."""
    shape = helpers.DATASET.input_shape

    def split(n):
        x = np.zeros((n, *shape), np.float32)
        x[:, 0, 0, 0] = np.arange(n)
        return x, (np.arange(n) % 10).astype(np.int32)
    return InMemoryDataset("indices", *split(num_train), *split(num_eval), num_classes=10)


DATA = index_dataset()


def expected_steps(start, stop, drop_remainder=True):
    stream = epochs.train_indices(DATA, GLOBAL_BATCH, SEED, start, drop_remainder)
    return [batch.numpy() for batch in stream.take(stop - start)]


@pytest.fixture
def consumed(monkeypatch):
    """Records, per tower, the example indices of every shard the tower trains on."""
    records = collections.defaultdict(list)
    original, shared = per_tower.tower_pass, per_tower.SharedPass.__call__

    def recorded(step, t, x):
        """x, each time the step runs, with its example indices recorded for tower t."""
        tower = int(step.replicas.tower_devices[t].rsplit(":", 1)[1])

        def record(shard):
            records[tower].append(shard.numpy()[:, 0, 0, 0].astype(np.int64))
            return shard
        seen = tf.py_function(record, [x], tf.float32)
        seen.set_shape(x.shape)
        return seen

    def recording_tower_pass(step, t, trainable, non_trainable, x, y):
        return original(step, t, trainable, non_trainable, recorded(step, t, x), y)

    def recording_shared_pass(self, step, group, trainable, states, xs, ys):  # the default
        return shared(self, step, group, trainable, states, [recorded(step, group[0], xs[0])],
                      ys)
    monkeypatch.setattr(per_tower, "tower_pass", recording_tower_pass)
    monkeypatch.setattr(per_tower.SharedPass, "__call__", recording_shared_pass)

    def global_batches():
        """The global batches trained on so far: tower shards concatenated, tower 0 first."""
        counts = {len(shards) for shards in records.values()}
        assert len(counts) == 1, "towers trained on different numbers of shards"
        return [np.concatenate([records[t][s] for t in sorted(records)])
                for s in range(counts.pop())]
    return global_batches


def staged_trainer(logdir, mode, depth, **overrides):
    config = helpers.small_config(logdir, devices="cpu:2", global_batch_size=GLOBAL_BATCH,
                                  learning_rate=1e-4, staging=mode, staging_depth=depth,
                                  **overrides)
    return helpers.build_trainer(config)


def fit(trainer, train_steps, steps_per_loop, **kwargs):
    start = int(trainer.global_step.numpy())
    batches = epochs.train_batches(DATA, GLOBAL_BATCH, SEED, start)
    return helpers.fit(trainer, batches, train_steps, GLOBAL_BATCH, steps_per_loop, **kwargs)


def finite_stream(batches) -> tf.data.Dataset:
    """The global batches of the example indices `batches`, and nothing after them."""
    return tf.data.Dataset.from_tensor_slices(
        (np.stack([DATA.train_x[b] for b in batches]),
         np.stack([DATA.train_y[b] for b in batches])))


def assert_batches_equal(actual, expected):
    assert len(actual) == len(expected)
    for step, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_array_equal(a, e, err_msg=f"step {step}")


MODES = [(mode, depth) for mode in ("none", "host", "device") for depth in (1, 2, 3)]


@pytest.mark.parametrize("mode,depth", MODES)
def test_every_example_once_in_order_through_fits_and_a_resume(mode, depth, consumed, logdir):
    trainer = staged_trainer(logdir, mode, depth)
    first = fit(trainer, train_steps=7, steps_per_loop=3)  # loops of 3, 3, 1: drains at the end
    assert (first.final_step, first.input_ended) == (7, False)
    assert trainer.staging.staged == 0
    assert_batches_equal(consumed(), expected_steps(0, 7))
    second = fit(trainer, train_steps=12, steps_per_loop=4)  # resumes in the same process
    assert (second.start_step, second.final_step) == (7, 12)
    assert trainer.staging.staged == 0
    assert_batches_equal(consumed(), expected_steps(0, 12))
    # 12 steps of 5 per epoch: epochs 0 and 1 whole, each example of an epoch once.
    flat = np.concatenate(consumed()[:10])
    for epoch in (flat[:40], flat[40:]):
        assert len(set(epoch.tolist())) == 40


@pytest.mark.parametrize("mode,depth", MODES)
def test_input_that_ends_mid_loop_and_mid_buffer(mode, depth, consumed, logdir):
    trainer = staged_trainer(logdir, mode, depth)
    batches = expected_steps(0, 9)

    def finite(begin, end):
        return iter(trainer.staging.pipeline(finite_stream(batches[begin:end])))

    five = finite(0, 5)
    assert trainer.train_loop(five, 2).steps == 2  # batches 2.. (K of them) stay staged
    assert trainer.staging.staged == (min(depth, 3) if mode == "device" else 0)
    result = trainer.train_loop(five, 10)  # the input ends: the staged batches drain
    assert result.steps == 3 and trainer.staging.staged == 0
    assert_batches_equal(consumed(), batches[:5])
    four = finite(5, 9)
    assert trainer.train_loop(four, 1).steps == 1
    other = finite(0, 2)  # another iterator: what `four` staged is dropped, not trained on
    assert trainer.train_loop(other, 5).steps == 2
    assert_batches_equal(consumed(), batches[:6] + batches[:2])


@pytest.mark.parametrize("mode,depth", [("host", 2), ("device", 1), ("device", 3)])
def test_input_that_ends_where_the_sampled_step_would_run(mode, depth, consumed, logdir):
    """With --diagnostics, a loop of N steps runs N - 1 ordinary steps and then the sampled
    step, if a batch is left. An input of N - 1 batches leaves none: the loop ends there
    (device staging would otherwise wait forever on empty staging areas; the loop runs
    in a thread so that a wait fails this test instead of hanging the suite)."""
    trainer = staged_trainer(logdir, mode, depth, diagnostics=True)
    batches = expected_steps(0, 3)
    stream = iter(trainer.staging.pipeline(finite_stream(batches)))
    results = []
    loop = threading.Thread(target=lambda: results.append(trainer.train_loop(stream, 4)),
                            daemon=True)
    loop.start()
    loop.join(timeout=120)
    assert results, "the loop waited for a batch the input never had"
    assert results[0].steps == 3 and results[0].stats == {}
    assert_batches_equal(consumed(), batches)


def test_loss_trajectories_identical_across_staging_modes(logdir):
    """Under --deterministic every mode trains on the same batches in the same order."""
    @dataclasses.dataclass
    class Recorder:
        losses: dict = dataclasses.field(default_factory=dict)

        def scalars(self, step, values):
            self.losses[step] = values["loss"]

    trajectories = {}
    for mode in ("none", "host", "device"):
        config = helpers.small_config(logdir, devices="cpu:4", aggregation="ring",
                                      staging=mode, staging_depth=2)
        trainer = helpers.build_trainer(config)
        recorder = Recorder()
        helpers.fit(trainer, helpers.DATASET.train_batches(helpers.GLOBAL_BATCH, config.seed),
                    train_steps=6, global_batch=helpers.GLOBAL_BATCH, steps_per_loop=4,
                    summary_every=1, summaries=recorder)
        trajectories[mode] = [recorder.losses[step] for step in range(1, 7)]
    assert trajectories["none"] == trajectories["host"] == trajectories["device"]
    assert trajectories["none"][-1] < trajectories["none"][0]  # it trained


def counting(batches, produced):
    """`batches` re-made example by example (map, then batch), counting the examples made.

    Map-then-batch is what tf.data's default optimizations turn into a parallel
    map-and-batch that works ahead on a background thread.
    """
    def count(x):
        produced.append(1)
        return x
    examples = batches.unbatch().map(
        lambda x, y: (tf.ensure_shape(tf.py_function(count, [x], tf.float32), x.shape), y))
    return examples.batch(GLOBAL_BATCH, drop_remainder=True)


READ_AHEAD_SCRIPT = """
import time
from mgloop.cluster import devices
devices.configure_logical_cpus(2)
from mgloop.runs import experiment
from tests import helpers, test_staging as ts
config = helpers.small_config(sys.argv[1], devices="cpu:2", global_batch_size=8,
                              staging="none", deterministic=False).validated()
trainer = experiment.build_trainer(config, devices.setup(devices.parse("cpu:2")),
                                   helpers.model_fn("mlp"), experiment.default_loss(),
                                   ts.DATA.input_shape)
def made(by_trainer, steps):
    produced = []
    batches = ts.counting(ts.epochs.train_batches(ts.DATA, 8, 3), produced)
    if by_trainer:
        iterator = iter(trainer.staging.pipeline(batches))
        assert trainer.train_loop(iterator, steps).steps == steps
    else:
        iterator = iter(batches)
        for _ in range(steps):
            next(iterator)
    time.sleep(0.3)
    return len(produced)
print(made(False, 4), made(True, 4))
"""


def test_none_makes_nothing_ahead_where_tf_data_would(tmp_path):
    """Without op determinism (which serializes stateful tf.data functions), tf.data's
    default optimizations make examples ahead; `none` makes exactly what the steps use."""
    result = subprocess.run([sys.executable, "-c", "import sys\n" + READ_AHEAD_SCRIPT,
                             str(tmp_path / "run")], capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert result.returncode == 0, result.stderr[-3000:]
    plain, synchronous = map(int, result.stdout.split()[-2:])
    assert plain > 4 * GLOBAL_BATCH  # the control: tf.data alone works ahead here
    assert synchronous == 4 * GLOBAL_BATCH


def test_device_stages_k_batches_ahead(logdir):
    trainer = staged_trainer(logdir, "device", depth=3)
    produced = []
    stream = counting(epochs.train_batches(DATA, GLOBAL_BATCH, SEED), produced)
    assert trainer.train_loop(iter(trainer.staging.pipeline(stream)), 4).steps == 4
    assert trainer.staging.staged == 3 and len(produced) >= (4 + 3) * GLOBAL_BATCH
    trainer.release_input()
    assert trainer.staging.staged == 0


def test_input_wait_covers_a_slow_input(logdir):
    """With a synchronous feed each step waits at least the input's delay."""
    delay = 0.03
    trainer = staged_trainer(logdir, "none", depth=1)

    def slow(x):
        time.sleep(delay)
        return x
    stream = epochs.train_batches(DATA, GLOBAL_BATCH, SEED).map(
        lambda x, y: (tf.ensure_shape(tf.py_function(slow, [x], tf.float32), x.shape), y))
    result = trainer.train_loop(iter(trainer.staging.pipeline(stream)), 4)
    assert result.steps == 4
    assert result.input_wait / result.steps >= 0.95 * delay
