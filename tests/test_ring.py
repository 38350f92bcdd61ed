"""The hand-written ring all-reduce, checked against numpy on logical CPU devices."""

import numpy as np
import pytest
import tensorflow as tf

from mgloop.aggregation.dense import ring
from mgloop.cluster.devices import DeviceSet
from tests import tolerance


@pytest.mark.parametrize("elements,chunks", [(10, 4), (3, 4), (0, 2), (8, 8), (7, 1)])
def test_chunk_sizes_cover_contiguously(elements, chunks):
    sizes = ring.chunk_sizes(elements, chunks)
    assert len(sizes) == chunks and sum(sizes) == elements
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_ring_orders_alternate_direction(shards):
    devices = [f"/device:CPU:{t}" for t in range(4)]
    orders = [ring.ring_order(devices, s) for s in range(shards)]
    assert orders[0] == [0, 1, 2, 3]
    if shards > 1:
        assert orders[1] == [3, 2, 1, 0]
    for order in orders:
        assert sorted(order) == [0, 1, 2, 3]


@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("towers", [2, 3, 4])
@pytest.mark.parametrize("shape", [(1,), (3,), (7, 5), (2, 3, 4)])
def test_ring_equals_numpy_and_is_identical_everywhere(towers, shape, shards, average):
    rng = np.random.default_rng(towers)
    values = [rng.standard_normal(shape).astype(np.float32) for _ in range(towers)]
    devices = tuple(f"/device:CPU:{t}" for t in range(towers))
    method = ring.Ring(DeviceSet(towers=devices), ring.RingOptions(shards=shards))
    placed = []
    for device, value in zip(devices, values):
        with tf.device(device):
            placed.append([tf.constant(value)])
    results = [out[0] for out in method.reduce(placed, variables=[None], average=average)]
    expected = np.mean(values, axis=0) if average else np.sum(values, axis=0)
    for device, result in zip(devices, results):
        assert result.device.endswith(device.split("/")[-1])
        tolerance.assert_within([result.numpy()], [expected],  # any order of the T terms
                                [tolerance.sum_bound(values, average)])
        np.testing.assert_array_equal(result.numpy(), results[0].numpy())


@pytest.mark.parametrize("towers,elements", [(3, 10), (4, 3)])
def test_reduce_scatter_leaves_each_tower_the_mean_of_the_chunk_it_owns(towers, elements):
    """The ring's two halves apart (a sharded update would run between them): after the
    reduce-scatter tower t holds the mean of chunk owned_chunk(t) on its device; the
    all-gather then gives every tower each owner's chunk, bit for bit."""
    rng = np.random.default_rng(elements)
    values = [rng.standard_normal(elements).astype(np.float32) for _ in range(towers)]
    devices = [f"/device:CPU:{t}" for t in range(towers)]
    method = ring.Ring(DeviceSet(towers=tuple(devices)))
    flats = []
    for device, value in zip(devices, values):
        with tf.device(device):
            flats.append(tf.constant(value))
    chunks = ring.ring_reduce_scatter(method, flats, devices, average=True)
    bounds = np.cumsum([0] + ring.chunk_sizes(elements, towers))
    owned = {ring.owned_chunk(t, towers) for t in range(towers)}
    assert owned == set(range(towers))  # every chunk has one owner
    for t in range(towers):
        c = ring.owned_chunk(t, towers)
        part = [value[bounds[c]:bounds[c + 1]] for value in values]
        assert chunks[t][c].device.endswith(f"CPU:{t}")
        tolerance.assert_within([chunks[t][c].numpy()], [np.mean(part, axis=0)],
                                [tolerance.sum_bound(part, True)])
    finished = {ring.owned_chunk(t, towers): chunks[t][ring.owned_chunk(t, towers)].numpy()
                for t in range(towers)}
    ring.ring_all_gather(method, chunks, devices)
    for t in range(towers):
        for c in range(towers):
            np.testing.assert_array_equal(chunks[t][c].numpy(), finished[c])
