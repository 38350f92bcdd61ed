"""Aggregation internals: placement, packing plans, and the bytes each mode moves per step."""

import numpy as np
import pytest
import tensorflow as tf

from mgloop.aggregation.base import canonical
from mgloop.aggregation.kernels import packing
from mgloop.cluster import workers as cluster, devices
from mgloop.runs import experiment
from tests import helpers



def parameter_bytes(trainer):
    return sum(v.shape.num_elements() * v.dtype.size for v in trainer.copies[0].trainable)


def traffic_after_one_step(logdir, **overrides):
    trainer, _ = helpers.train_mgloop(helpers.small_config(logdir, **overrides),
                                      helpers.batches(1))
    return trainer, trainer.aggregation.traffic


def test_ps_spread_balances_variables_and_colocates_slots(logdir):
    trainer, _ = helpers.train_mgloop(
        helpers.small_config(logdir, devices="cpu:4", aggregation="ps_spread"), helpers.batches(1))
    load = {}
    for v in trainer.copies[0].trainable:
        load[canonical(v.device)] = load.get(canonical(v.device), 0) + v.shape.num_elements()
    assert len(load) == 4  # every tower device holds variables
    sizes = sorted(v.shape.num_elements() for v in trainer.copies[0].trainable)
    assert max(load.values()) == sizes[-1]  # greedy: the biggest tensor sits alone
    optimizer = trainer.copies[0].optimizer
    slots = [v for v in optimizer.variables if len(v.shape) > 0]
    by_shape = {}
    for v in trainer.copies[0].trainable:
        by_shape.setdefault(tuple(v.shape), set()).add(canonical(v.device))
    for slot in slots:
        assert canonical(slot.value.device) in by_shape[tuple(slot.shape)]


def test_packing_plan_keeps_order_and_bound():
    values = [tf.zeros([n]) for n in (10, 300, 5, 5, 2000, 1)]
    buckets = packing.plan(values, bucket_bytes=1250)  # 10+300 floats fit, +5 does not
    assert [i for b in buckets for i in b] == list(range(6))
    assert buckets == [[0, 1], [2, 3], [4], [5]]
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in ([2, 5], [300], [5], [5, 1],
                                                                   [40, 50], [1])]
    packed = packing.pack([tf.constant(a) for a in arrays], buckets, "/device:CPU:0")
    restored = packing.unpack(packed, buckets, [tf.TensorShape(a.shape) for a in arrays],
                              "/device:CPU:1")
    for a, r in zip(arrays, restored):
        np.testing.assert_array_equal(a, r.numpy())


def test_packing_by_dtype_groups_every_tensor_of_a_dtype_in_one_bucket():
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array(7, dtype=np.int64),
              np.float32(0.5), np.arange(4, dtype=np.float64), np.array([[3], [4]], np.int64)]
    values = [tf.constant(a) for a in arrays]
    buckets = packing.plan_by_dtype(values)
    assert buckets == [[0, 2], [1, 4], [3]]  # dtypes in order of first appearance
    packed = packing.pack(values, buckets, "/device:CPU:0")
    assert [p.shape.as_list() for p in packed] == [[7], [3], [4]]
    restored = packing.unpack(packed, buckets, [v.shape for v in values], "/device:CPU:1")
    for a, r in zip(arrays, restored):
        assert r.dtype == a.dtype
        np.testing.assert_array_equal(a, r.numpy())


def test_cross_worker_stage_makes_one_collective_per_step(logdir, monkeypatch):
    """The stage between workers, in-process: the collective is replaced by a peer that
    contributed the same sums (x2), so the mean gradient, hence the weights, equal one
    worker's, the loss is the same and the accuracy counts double; a step makes ONE
    collective carrying the gradients and the metrics, counted as 2(W-1)/W of its bytes."""
    config = helpers.small_config(logdir, devices="cpu:2", aggregation="ring")
    batches = helpers.batches(1)
    stream = tf.data.Dataset.from_tensor_slices(
        (np.stack([x for x, _ in batches]), np.stack([y for _, y in batches])))
    alone = helpers.build_trainer(config)
    alone_result = alone.train_loop(iter(stream), 1)
    device_set = devices.setup(devices.parse(config.devices, config.towers_per_device))
    peers = cluster.Cluster(("localhost:1", "localhost:2"), index=0)
    trainer = experiment.build_trainer(config.validated(), device_set, helpers.model_fn("mlp"),
                                       experiment.default_loss(), helpers.DATASET.input_shape,
                                       workers=peers)
    collectives = []

    def identical_peer(value):
        collectives.append(value.shape.as_list())
        return value * 2

    monkeypatch.setattr(trainer.aggregation, "all_workers_sum", identical_peer)
    result = trainer.train_loop(iter(stream), 1)
    p = parameter_bytes(trainer)
    assert collectives == [[p // 4 + 3]]  # every gradient, the loss, the 2 counts; traced once
    local, crossing = alone.aggregation.traffic, trainer.aggregation.traffic
    between_workers = (p + 12) * 2 * (2 - 1) // 2  # sent, and received, by copy 0's device
    assert crossing.received["CPU:0"] - local.received["CPU:0"] == between_workers
    assert crossing.sent["CPU:0"] - local.sent["CPU:0"] == between_workers + p  # + to copy 1
    assert crossing.received["CPU:1"] - local.received["CPU:1"] == p
    assert result.loss_sum == alone_result.loss_sum  # (2 l) / 2 and 2 s / (2 T): exact
    correct, compared = result.metric_sums["accuracy"]
    alone_correct, alone_compared = alone_result.metric_sums["accuracy"]
    assert correct == 2 * alone_correct
    assert compared == 2 * alone_compared == 2 * helpers.GLOBAL_BATCH
    for copy, alone_copy in zip(trainer.copies, alone.copies):
        for a, b in zip(copy.trainable, alone_copy.trainable):
            np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_ring_moves_two_times_t_minus_one_over_t_of_the_gradient(logdir):
    trainer, traffic = traffic_after_one_step(logdir, devices="cpu:4", aggregation="ring")
    p = parameter_bytes(trainer)
    assert sum(traffic.sent.values()) == 2 * 3 * p  # (T-1) P per phase, over all towers
    for device in ("CPU:0", "CPU:1", "CPU:2", "CPU:3"):
        assert traffic.sent[device] == pytest.approx(2 * 3 / 4 * p, rel=0.01)
        assert traffic.received[device] == pytest.approx(2 * 3 / 4 * p, rel=0.01)


def test_float16_transport_halves_the_bytes(logdir):
    trainer, full = traffic_after_one_step(logdir, devices="cpu:4", aggregation="ring")
    full = dict(full.sent)
    _, half = traffic_after_one_step(logdir, devices="cpu:4", aggregation="ring",
                                     transport_dtype="float16")
    assert half.sent == {d: n // 2 for d, n in full.items()}


def test_reduce_broadcast_concentrates_traffic_on_tower_zero(logdir):
    trainer, traffic = traffic_after_one_step(logdir, devices="cpu:4",
                                              aggregation="reduce_broadcast")
    p = parameter_bytes(trainer)
    assert traffic.received["CPU:0"] == traffic.sent["CPU:0"] == 3 * p
    assert all(traffic.sent[d] == traffic.received[d] == p for d in ("CPU:1", "CPU:2", "CPU:3"))


def test_parameter_server_reads_and_gradients(logdir):
    """ps_cpu: the host is also tower 0's device, so tower 0 moves nothing."""
    trainer, traffic = traffic_after_one_step(logdir, devices="cpu:4", aggregation="ps_cpu")
    p = parameter_bytes(trainer)
    assert traffic.sent["CPU:0"] == traffic.received["CPU:0"] == 3 * p
    assert all(traffic.sent[d] == traffic.received[d] == p for d in ("CPU:1", "CPU:2", "CPU:3"))


def test_hierarchical_moves_as_much_as_the_ring_in_total(logdir):
    trainer, traffic = traffic_after_one_step(logdir, devices="cpu:4", aggregation="hierarchical")
    p = parameter_bytes(trainer)
    assert sum(traffic.sent.values()) == 2 * 3 * p
    assert traffic.sent["CPU:1"] == traffic.sent["CPU:3"] == p  # members: up to the leader


def test_independent_moves_nothing(logdir):
    _, traffic = traffic_after_one_step(logdir, devices="cpu:4", aggregation="independent")
    assert sum(traffic.sent.values()) == 0


def test_run_reports_traffic_and_exchange_time(logdir):
    import mgloop
    summary = mgloop.run(helpers.small_config(logdir, devices="cpu:4", aggregation="ring",
                                              train_steps=3, time_exchange=True))
    trainer, traffic = traffic_after_one_step(logdir + "_2", devices="cpu:4", aggregation="ring")
    assert summary["traffic_bytes_per_step"] == traffic.as_dict()
    assert summary["exchange_seconds"] > 0
    # each copy: momentum for every entry (P bytes) and its int64 step count (8 bytes)
    state = summary["optimizer_bytes_per_device"]
    p = parameter_bytes(trainer)
    assert state == {"state": {device: 8 + p for device in trainer.aggregation.devices.towers},
                     "owned_weights": {}}
    colocated = mgloop.run(helpers.small_config(logdir + "_3", devices="cpu:2",
                                                aggregation="colocate", train_steps=3,
                                                time_exchange=True))
    assert colocated["exchange_seconds"] is None  # one loss: no exchange of its own
