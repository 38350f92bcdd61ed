"""Sparse gradients: an Embedding's rows travel as rows where that moves fewer bytes, with
exact byte counts (values + indices), equal to one device; dense with --sparse_as_dense."""

from __future__ import annotations

import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from mgloop import aggregation
from mgloop.cluster import devices
from mgloop.step import sparse_gradients
from tests import helpers, tolerance

VOCAB, WIDTH, LENGTH, CLASSES, TOWERS, STEPS = 500, 8, 4, 5, 4, 3


def embedding_model():
    tokens = keras.Input((LENGTH,), dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCAB, WIDTH)(tokens))
    return keras.Model(tokens, keras.layers.Dense(CLASSES)(h))


@pytest.fixture(scope="module")
def steps_batches():
    rng = np.random.default_rng(5)
    return [(rng.integers(0, VOCAB, (helpers.GLOBAL_BATCH, LENGTH)).astype(np.int32),
             rng.integers(0, CLASSES, helpers.GLOBAL_BATCH).astype(np.int32))
            for _ in range(STEPS)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, steps_batches):
    config = helpers.small_config(str(tmp_path_factory.mktemp("ref") / "run"))
    return helpers.train_reference_bounded(config, steps_batches, embedding_model)


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_embedding_in_ps_cpu_bytes_exact_and_equal_to_one_device(
        tmp_path, steps_batches, reference, sparse_as_dense):
    config = helpers.small_config(str(tmp_path / "run"), devices=f"cpu:{TOWERS}",
                                  aggregation="ps_cpu", sparse_as_dense=sparse_as_dense)
    trainer = helpers.build_trainer(config, embedding_model, input_shape=(LENGTH,))
    loss_sum = helpers.run_batches(trainer, steps_batches)
    tolerance.assert_matches_reference(helpers.copy_weights(trainer)[0], loss_sum, reference)
    # Every variable lives on the host CPU:0 (tower 0's device too): towers 1..3 read all
    # of them and send back their gradients; the table's as rows (one per token of the shard:
    # float32 values [rows, WIDTH] + int32 indices [rows]) unless --sparse_as_dense.
    params = 4 * (VOCAB * WIDTH + WIDTH * CLASSES + CLASSES)
    rows = helpers.GLOBAL_BATCH // TOWERS * LENGTH
    table = 4 * VOCAB * WIDTH if sparse_as_dense else rows * (4 * WIDTH + 4)
    sent = table + 4 * (WIDTH * CLASSES + CLASSES)
    expected = {"CPU:0": {"sent": 3 * params, "received": 3 * sent}}
    expected.update({f"CPU:{t}": {"sent": sent, "received": params} for t in (1, 2, 3)})
    assert trainer.aggregation.traffic.as_dict() == expected
    assert trainer.step.exchange.plan.kept == ([] if sparse_as_dense else [0])
    assert trainer.time_exchange(repeats=1, per_call=1) > 0  # its stand-ins are rows too
    assert trainer.step.exchange.plan.kept == ([] if sparse_as_dense else [0])


def test_rows_where_fewer_bytes_and_counted_with_their_indices():
    """The rule of sparse_gradients.keeps_sparse, and `send` counting values in the transport
    dtype plus indices in theirs (numpy-level: no step traced)."""
    device_set = devices.setup(devices.parse("cpu:4"))
    method = aggregation.make("ps_cpu", device_set, "float16")
    rows = tf.IndexedSlices(tf.ones([16, WIDTH]), tf.range(16), tf.constant([VOCAB, WIDTH]))
    moved = method.send(rows, device_set.towers[1], device_set.host)
    assert isinstance(moved, tf.IndexedSlices)
    assert method.traffic.as_dict()["CPU:1"]["sent"] == 16 * WIDTH * 2 + 16 * 4
    np.testing.assert_array_equal(moved.values.numpy(), rows.values.numpy())
    table = types.SimpleNamespace(shape=tf.TensorShape([VOCAB, WIDTH]), dtype=tf.float32)
    small = types.SimpleNamespace(shape=tf.TensorShape([10, WIDTH]), dtype=tf.float32)
    home = sparse_gradients.route(method, sparse_as_dense=False)
    assert home == sparse_gradients.HOME
    assert sparse_gradients.keeps_sparse(home, rows, table, method)  # 16 rows < 500
    assert not sparse_gradients.keeps_sparse(home, rows, small, method)  # 16 rows > 10
    assert sparse_gradients.route(method, sparse_as_dense=True) is None
    ring = aggregation.make("ring", device_set)
    assert sparse_gradients.route(ring, False) == sparse_gradients.ALL_GATHER
    # all-gather: 3 x 16 x (8 x 4 + 4) = 1728 bytes per tower < 2 x 3/4 x 500 x 8 x 4 = 24000
    assert sparse_gradients.keeps_sparse(sparse_gradients.ALL_GATHER, rows, table, ring)
    big_shard = tf.IndexedSlices(tf.ones([200, WIDTH]), tf.range(200))  # 21600 > 12000
    assert not sparse_gradients.keeps_sparse(
        sparse_gradients.ALL_GATHER, big_shard,
        types.SimpleNamespace(shape=tf.TensorShape([VOCAB // 2, WIDTH]), dtype=tf.float32), ring)
