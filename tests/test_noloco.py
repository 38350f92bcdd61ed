"""NoLoCo (mgloop/aggregation/local/noloco.py): random groups at each outer step, a numpy model of
the outer step, the bytes of one peer, its degenerate setting against DiLoCo, refusals."""

import numpy as np
import pytest
import tensorflow as tf

from mgloop import aggregation
from mgloop.aggregation.local import noloco
from mgloop.cluster import devices
from mgloop.errors import ConfigError
from tests import helpers, tolerance
from tests.copies_by_hand import assert_copies_equal, inner_steps_by_hand, method_on_copies

F32 = np.float32
SHAPES = [(3, 4), (4,), (5,)]  # 21 parameters
SEED = 13


def groups(seed, outer_step, nodes, size):
    return noloco.groups_at(seed, tf.constant(outer_step, tf.int64), nodes, size).numpy()


def test_groups_partition_the_nodes_alike_everywhere_and_change_with_the_outer_step():
    """Every group has `size` members; the draw is a function of (seed, outer step) alone;
    over 20 outer steps of 4 nodes in pairs each node meets every other node."""
    devices.setup(devices.parse("cpu:2"))
    for nodes, size in ((4, 2), (8, 2), (8, 4), (6, 3), (4, 4)):
        for k in range(6):
            drawn = groups(SEED, k, nodes, size)
            assert sorted(np.bincount(drawn)) == [size] * (nodes // size)
            with tf.device("/device:CPU:1"):
                np.testing.assert_array_equal(drawn, groups(SEED, k, nodes, size))
    met = {i: set() for i in range(4)}
    for k in range(20):
        drawn = groups(SEED, k, 4, 2)
        for i in range(4):
            met[i] |= {j for j in range(4) if j != i and drawn[j] == drawn[i]}
    assert all(peers == set(range(4)) - {i} for i, peers in met.items())
    assert any((groups(SEED, k, 4, 2) != groups(SEED + 1, k, 4, 2)).any() for k in range(4))


class NumpyNoLoCo:
    """The module's outer step in float32 numpy, in its order of operations."""

    def __init__(self, init, nodes, options):
        self.theta = [[w.copy() for w in init] for _ in range(nodes)]
        self.x = [[w.copy() for w in init] for _ in range(nodes)]
        self.velocity = [[np.zeros_like(w) for w in init] for _ in range(nodes)]
        self.options = options

    def outer_step(self, drawn):
        size, b, a, g = (self.options[k] for k in ("group", "outer_lr", "outer_momentum",
                                                   "gamma"))
        nodes = len(self.x)
        new_x = []
        for i in range(nodes):
            row = []
            for v in range(len(self.x[i])):
                x_sum = theta_sum = None
                for j in range(nodes):
                    keep = drawn[j] == drawn[i]
                    xj = self.x[j][v] if keep else np.zeros_like(self.x[j][v])
                    tj = self.theta[j][v] if keep else np.zeros_like(self.theta[j][v])
                    x_sum = xj if x_sum is None else x_sum + xj
                    theta_sum = tj if theta_sum is None else theta_sum + tj
                x_bar = x_sum * F32(1.0 / size)
                g_bar = x_bar - theta_sum * F32(1.0 / size)
                self.velocity[i][v] = (F32(a) * self.velocity[i][v] - F32(b) * g_bar
                                       - F32(g) * (self.x[i][v] - x_bar))
                row.append(self.x[i][v] + self.velocity[i][v])
            new_x.append(row)
        self.x = new_x
        self.theta = [[w.copy() for w in row] for row in new_x]


def outer_step_bound(model, size, outer_steps) -> float:
    """|mgloop - model| after `outer_steps` outer steps, any order of each step's float32
    operations: a step forms each value from at most size + 6 roundings of terms no larger
    than M (the largest |x|, |theta|, |v| of the model, times 1 + a + b + g <= 3 for the
    options here): 2 gamma(size + 6) 3 M apart; a difference carried into the next step is
    scaled by at most 1 + a + b + g <= 3 (x, v and the group's means are linear in it)."""
    magnitude = max(float(np.abs(w).max()) for rows in (model.x, model.theta, model.velocity)
                    for row in rows for w in row)
    per_step = 2 * tolerance.gamma(size + 6) * 3 * magnitude
    return sum(per_step * 3 ** k for k in range(outer_steps))


@pytest.mark.parametrize("nodes, size", [(4, 2), (4, 4), (2, 2)])
def test_equals_numpy_model_and_counts_one_peers_bytes(nodes, size):
    """Hand-made inner progress, 7 steps at H = 2 (outer steps after steps 1, 3, 5): every
    node's parameters, x_i and v_i equal the numpy model's (the same float32 operations in
    the same order) within `outer_step_bound`: Grappler's arithmetic optimizer may
    reassociate a node's terms (measured: one node's velocity 1 ulp apart at n = N = 4;
    bit-equal with arithmetic_optimization off). The traced traffic of an outer step is,
    per node, x and theta (21 float32 each) to each of its size - 1 peers, and nothing on
    any other step."""
    spec = f"noloco:period=2,group={size},outer_lr=0.6,outer_momentum=0.8,gamma=0.3"
    tf.random.set_seed(SEED)
    rng = np.random.default_rng(5)
    init = [rng.standard_normal(shape).astype(F32) for shape in SHAPES]
    method, copies = method_on_copies(spec, nodes, init, step_fn=False)
    with method.step():
        after_update = tf.function(lambda: method.after_update(copies)).get_concrete_function()
    sync = method.traffic.of_occasion("sync")
    assert [sync.sent[d] for d in sync.devices()] == [2 * 21 * 4 * (size - 1)] * nodes
    assert sync.received == sync.sent
    assert sum(method.traffic.of_occasion("every step").sent.values()) == 0
    model = NumpyNoLoCo(init, nodes, dict(group=size, outer_lr=0.6, outer_momentum=0.8,
                                          gamma=0.3))
    for s in range(7):
        inner_steps_by_hand(model.theta, copies, rng, SHAPES)
        method.step_counter.assign(s)
        after_update()
        if (s + 1) % 2 == 0:
            model.outer_step(groups(SEED, (s + 1) // 2, nodes, size))
        bound = outer_step_bound(model, size, (s + 1) // 2)
        for got, want in (([[v.numpy() for v in c.trainable] for c in copies], model.theta),
                          ([[x.numpy() for x in xs] for xs in method._start], model.x),
                          ([[m.numpy() for m in ms] for ms in method._momentum],
                           model.velocity)):
            for a, b in zip(got, want):
                for x, y in zip(a, b):
                    np.testing.assert_allclose(x, y, rtol=0, atol=bound)
    if size < nodes:  # the nodes' outer parameters differ; the model produced is their mean
        assert any((method._start[0][0].numpy() != xs[0].numpy()).any()
                   for xs in method._start[1:])


def test_two_nodes_in_one_group_at_outer_rate_1_are_diloco_without_nesterov(tmp_path):
    """N = n = 2, b = 1: xbar = x (x + x is exact), gbar is DiLoCo's delta (the same two-term
    mean), the pull is 0 and v = -m, so the weights are bit-equal to diloco:nesterov=false
    trained on the same batches."""
    from tests.copies_by_hand import trained_side_by_side
    specs = ["noloco:period=2,group=2,outer_lr=1,outer_momentum=0.9,gamma=0.5",
             "diloco:period=2,outer_lr=1,outer_momentum=0.9,nesterov=false"]
    (_, mine), (_, theirs) = trained_side_by_side(tmp_path, specs, 2, 5)
    assert_copies_equal(mine, theirs)


def test_refusals_are_one_line(tmp_path):
    for settings, words in [
            (dict(devices="cpu:4", nodes=4, aggregation="noloco:group=3"), "divide"),
            (dict(devices="cpu:4", nodes=4, aggregation="noloco:group=1"), "divide"),
            (dict(devices="cpu:4", nodes=4, aggregation="noloco:gamma=nan"), "gamma"),
            (dict(devices="cpu:4", nodes=4, aggregation="noloco",
                  node_failures="1@2-3"), "node_failures")]:
        with pytest.raises(ConfigError) as error:
            helpers.small_config(str(tmp_path), **settings).validated()
        assert "\n" not in str(error.value) and words in str(error.value)
    assert aggregation.get("noloco").capabilities.resize_refusal


def test_four_nodes_train_and_evaluate_the_mean_of_their_outer_parameters(tmp_path):
    """--nodes=4 on 4 towers, H = 2, 4 steps: the run's between-node bytes per node and sync
    are x and theta of the two-hidden-layer mlp's 42,506 parameters, float32, to one peer (340,048 B, two
    messages), 170,024 B a step on average; the model evaluated is the nodes' mean x."""
    import json
    import mgloop
    config = helpers.small_config(str(tmp_path), devices="cpu:4", nodes=4, mlp_depth=2,
                                  aggregation="noloco:period=2", train_steps=4,
                                  steps_per_loop=4)
    result = mgloop.run(config)
    with open(tmp_path / "summary.json") as handle:
        summary = json.load(handle)
    assert summary["evaluated_model"] == "mean of the 4 nodes' outer parameters"
    sync = summary["link_model"]["syncs"]["sync"]
    assert (sync["bytes_per_device"], sync["messages_per_device"], sync["occurrences"]) == (
        2 * 42506 * 4, 2, 2)
    assert summary["link_model"]["tiers"]["between"]["gradient"]["bytes_per_device"] == (
        2 * 42506 * 4 / 2)
    method = result.trainer.aggregation.inner
    x = [np.concatenate([v.numpy().ravel() for v in xs]) for xs in method._start]
    assert all(np.isfinite(v).all() for v in x) and any((x[0] != v).any() for v in x[1:])
    mean = np.mean(x, axis=0, dtype=np.float64)
    produced = np.concatenate([w.ravel() for w in result.model.get_weights()])
    # a float32 sum of 4 terms (then * 1/4, exact): within gamma(3) (1/4) sum_i |x_i|
    bound = tolerance.gamma(3) * np.sum(np.abs(x), axis=0) / 4
    assert (np.abs(produced - mean) <= bound).all()
