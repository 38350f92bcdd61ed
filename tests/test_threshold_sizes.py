"""threshold's variable-size transport (compression/threshold.py, sizes_first.py) and the
bytes counted when the step runs (aggregation/measured.py, Traffic.with_measured).

Against a numpy model of the exchange written op for op on hand-made gradients: which
entries pass, the residuals, every replica's output (bit for bit: the same float32
additions in sender order), and the bytes of two compiled steps in which different
numbers of entries pass, against a hand count from those numbers: the sizes message
(4 bytes per variable, counted when traced) plus each variable's values and indices
padded to the largest count (counted when run). value=0 against the dense mean within a
stated float32 bound. Between 2 real workers: tests/test_nodes_workers.py.
"""

import numpy as np
import pytest
import tensorflow as tf

from mgloop import aggregation
from mgloop.aggregation.traffic import Occasion, Traffic
from mgloop.cluster import devices
from mgloop.observe import link_report

TOWERS, VALUE = 3, 0.5
SHAPES = [(2, 3), (5,), (300,)]  # 300 entries: indices at uint16 (2 bytes), else uint8
INDEX_BYTES = [1, 1, 2]


def hand_made(step):
    """g[t][i]: eighths in [-1, 1] (exact in float32 and bfloat16), a pattern per step
    and tower, so that the counts passing |x| >= 0.5 differ between the two steps."""
    out = []
    for t in range(TOWERS):
        per_tower = []
        for i, shape in enumerate(SHAPES):
            j = np.arange(int(np.prod(shape)))
            eighths = (j * (3 + 2 * step) + 5 * t + 7 * i + 11 * step) % 17 - 8
            per_tower.append((eighths / 8.0).reshape(shape).astype(np.float32))
        out.append(per_tower)
    return out


def made(spec, transport_dtype="float32"):
    method = aggregation.make(spec, devices.setup(devices.parse(f"cpu:{TOWERS}")),
                              transport_dtype)
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    method.build(variables)
    return method, variables, tf.function(method.reduce)


def run(method, variables, step_fn, values):
    placed = []
    for device, per_tower in zip(method.devices.towers, values):
        with tf.device(device):
            placed.append([tf.constant(g) for g in per_tower])
    return [[v.numpy() for v in copy] for copy in step_fn(placed, variables)]


def model_step(values, residuals, value, memory=True):
    """The exchange in numpy float32, op for op: (out[i], counts[t][i]); updates residuals."""
    outs, counts = [], [[0] * len(SHAPES) for _ in range(TOWERS)]
    for i in range(len(SHAPES)):
        total = np.zeros(int(np.prod(SHAPES[i])), np.float32)
        for t in range(TOWERS):  # scatter-added in sender order
            x = values[t][i].ravel() + (residuals[t][i] if memory else np.float32(0))
            passed = np.abs(x) >= np.float32(value)
            c = np.where(passed, x, np.float32(0)).astype(np.float32)
            total[passed] = total[passed] + c[passed]
            residuals[t][i] = (x - c).astype(np.float32)
            counts[t][i] = int(passed.sum())
        outs.append((total * np.float32(1.0 / TOWERS)).reshape(SHAPES[i]))
    return outs, counts


def hand_bytes(counts, value_bytes):
    """What one tower sends (and receives) in one step: T-1 hops of the sizes message and
    of the payload buffer, each variable padded to the largest count of the step."""
    payload = sum(max(counts[t][i] for t in range(TOWERS)) * (value_bytes + INDEX_BYTES[i])
                  for i in range(len(SHAPES)))
    return (TOWERS - 1) * 4 * len(SHAPES), (TOWERS - 1) * payload


def test_two_steps_equal_the_numpy_model_and_count_the_bytes_that_pass():
    method, variables, step_fn = made(f"threshold:value={VALUE}")
    residuals = [[np.zeros(int(np.prod(s)), np.float32) for s in SHAPES]
                 for _ in range(TOWERS)]
    payloads, before = [], 0
    for step in range(2):
        values = hand_made(step)
        out = run(method, variables, step_fn, values)
        expected, counts = model_step(values, residuals, VALUE)
        for copy in out:  # every replica: the model's float32 additions, bit for bit
            for got, want in zip(copy, expected):
                np.testing.assert_array_equal(got, want)
        for t in range(TOWERS):
            for i in range(len(SHAPES)):
                np.testing.assert_array_equal(method.residuals[t][i].numpy().ravel(),
                                              residuals[t][i])
        sizes, payload = hand_bytes(counts, 4)
        payloads.append(payload)
        for t, device in enumerate(method.devices.towers):  # counted as the step ran
            key = f"CPU:{t}"
            assert method.measured.sent[key].numpy() == before + payload
            assert method.measured.received[key].numpy() == before + payload
        before += payload
    assert payloads[0] != payloads[1] and min(payloads) > 0  # the count varies per step
    # traced once: the sizes and 2 (T-1) messages per step; the payloads' mean when run
    mean = link_report.Schedule(method.traffic, 2).mean_traffic()
    per_step = sizes + (payloads[0] + payloads[1]) / 2
    assert mean.as_dict() == {f"CPU:{t}": {"sent": per_step, "received": per_step}
                              for t in range(TOWERS)}
    assert mean.messages_as_dict() == {f"CPU:{t}": {"sent": 2 * (TOWERS - 1),
                                                    "received": 2 * (TOWERS - 1)}
                                       for t in range(TOWERS)}


def test_bfloat16_values_travel_at_two_bytes():
    """memory=none: the counts are those of each step's own gradients."""
    method, variables, step_fn = made(f"threshold:value={VALUE},memory=none", "bfloat16")
    residuals = [[None] * len(SHAPES) for _ in range(TOWERS)]
    total = 0
    for step in range(2):
        values = hand_made(step)
        out = run(method, variables, step_fn, values)
        expected, counts = model_step(values, residuals, VALUE, memory=False)
        for got, want in zip(out[0], expected):  # eighths: exact in bfloat16 too
            np.testing.assert_array_equal(got, want)
        total += hand_bytes(counts, 2)[1]
        assert method.measured.sent["CPU:0"].numpy() == total


def test_value_zero_is_the_dense_mean():
    """Every entry passes: out = ((0 + g_0) + g_1 + ...) * fl(1/T) in float32, within
    gamma_{T+1} sum_t |g_t| / T (gamma_n = n u / (1 - n u), u = 2^-24: T-1 roundings of
    the additions, one of 1/T, one of the product) of the exact mean; nothing is kept."""
    method, variables, step_fn = made("threshold:value=0")
    rng = np.random.default_rng(5)
    values = [[rng.normal(size=s).astype(np.float32) for s in SHAPES] for _ in range(TOWERS)]
    out = run(method, variables, step_fn, values)
    u = 2.0 ** -24
    gamma = (TOWERS + 1) * u / (1 - (TOWERS + 1) * u)
    for i in range(len(SHAPES)):
        stacked = np.stack([values[t][i].astype(np.float64) for t in range(TOWERS)])
        bound = gamma * np.abs(stacked).sum(axis=0) / TOWERS
        for copy in out:
            assert np.all(np.abs(copy[i] - stacked.mean(axis=0)) <= bound)
        for t in range(TOWERS):
            assert not np.any(method.residuals[t][i].numpy())
    payload = sum(int(np.prod(s)) * (4 + b) for s, b in zip(SHAPES, INDEX_BYTES))
    assert method.measured.sent["CPU:1"].numpy() == (TOWERS - 1) * payload


class _Total:
    """A run-time total as with_measured reads it (a tf.Variable's .numpy())."""

    def __init__(self, value):
        self.value = value

    def numpy(self):
        return np.int64(self.value)


@pytest.mark.parametrize("steps", [4, 6])
def test_a_measured_total_is_spread_over_the_steps_its_occasion_occurred_on(steps):
    """A total of 300 bytes on an occasion of every other step: 300 / (steps / 2) per
    occurrence, so (300 / (steps / 2)) (steps / 2) / steps = 300 / steps per step."""
    traffic = Traffic()
    sync = Occasion("sync", lambda s: s % 2 == 1)
    with traffic.on(sync):
        traffic.add("CPU:0", messages_sent=1, tier="within")
        traffic.measure("CPU:0", "within", sent=_Total(300))
        traffic.measure("CPU:0", "within", sent=_Total(300))  # another total: added
    schedule = link_report.Schedule(traffic, steps)
    assert schedule.mean_traffic().sent == {"CPU:0": pytest.approx(600 / steps)}
    one = schedule.traffic.of_occasion("sync")
    assert one.sent == {"CPU:0": pytest.approx(600 / (steps // 2))}
    assert traffic.sent == {"CPU:0": 0}  # the traced counts are left as traced
