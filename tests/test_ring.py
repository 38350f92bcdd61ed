"""The hand-written ring all-reduce, checked against numpy on logical CPU devices."""

import numpy as np
import pytest
import tensorflow as tf

from mgloop.aggregation import ring
from mgloop.devices import DeviceSet


@pytest.mark.parametrize("elements,chunks", [(10, 4), (3, 4), (0, 2), (8, 8), (7, 1)])
def test_chunk_sizes_cover_contiguously(elements, chunks):
    sizes = ring.chunk_sizes(elements, chunks)
    assert len(sizes) == chunks and sum(sizes) == elements
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("towers", [2, 3, 4])
@pytest.mark.parametrize("shape", [(1,), (3,), (7, 5), (2, 3, 4)])
def test_ring_mean_equals_numpy_and_is_identical_everywhere(towers, shape):
    rng = np.random.default_rng(towers)
    values = [rng.standard_normal(shape).astype(np.float32) for _ in range(towers)]
    devices = [f"/device:CPU:{t}" for t in range(towers)]
    placed = []
    for device, value in zip(devices, values):
        with tf.device(device):
            placed.append(tf.constant(value))
    method = ring.Ring(DeviceSet(towers=tuple(devices)))
    results = ring.sharded_ring_all_reduce(method, placed, devices, shards=1, average=True)
    expected = np.mean(values, axis=0)
    for device, result in zip(devices, results):
        assert result.device.endswith(device.split("/")[-1])
        np.testing.assert_allclose(result.numpy(), expected, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(result.numpy(), results[0].numpy())
