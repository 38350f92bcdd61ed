"""Node failures (mgloop/aggregation/placement/node_failures.py): simulated nodes leave and return.

1. An exact method (ring between 4 one-tower nodes) with node 2 down for steps [1, 3) is
   the one-device run on the same global batches with node 2's shard left out on those
   steps (the mean over the live nodes), within the float32 bound of tests/tolerance.py;
   node 2's copy is frozen while it is down and equal to node 0's when it is back.
2. DiLoCo between 3 nodes, node 2 down mid-period and back, node 1 gone for good: the
   copies, outer parameters x and outer momenta equal a numpy model of the rule on
   hand-made gradients, op for op; a returning node's copy equals the live model then.
3. The refusals, one line each.
"""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from mgloop import settings
from mgloop.aggregation.local.local_steps import slot_variables
from mgloop.aggregation.placement import node_failures
from mgloop.cluster import devices
from mgloop.errors import ConfigError
from mgloop.step.hooks.node_failures import hook_for
from mgloop.step.replicas import Replicas
from mgloop.training import optim
from tests import helpers, tolerance
from tests.copies_by_hand import method_at_nodes


def test_an_exact_method_gives_the_mean_over_the_live_nodes(tmp_path):
    """ring, --nodes=4 of one tower (4 examples each), momentum, 5 steps, node 2 down for
    steps 1 and 2. Reference: one device on the same batches, rows 8..11 (node 2's shard)
    removed on steps 1 and 2: its gradient is the mean over the 12 live examples, i.e.
    (1/3) sum of the live nodes' means, which the ring among the 3 live nodes forms in
    another order: within tolerance.StepBound (any summation order). Bytes: on steps 1
    and 2 node 2 sends nothing and receives only its recovery (at the end of step 2), and
    the live nodes run a 3-node ring."""
    config = helpers.small_config(str(tmp_path), devices="cpu:4", nodes=4, aggregation="ring",
                                  node_failures="2@1-3")
    trainer = helpers.build_trainer(config)
    batches = helpers.batches(5)
    helpers.run_batches(trainer, batches[:1])
    before = [v.numpy() for v in _state(trainer.copies[2])]
    helpers.run_batches(trainer, batches[1:2])
    frozen = [v.numpy() for v in _state(trainer.copies[2])]
    for a, b in zip(before, frozen):  # a down node takes no update: slots and step count too
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(helpers.copy_weights(trainer)[0][0], before[0])
    helpers.run_batches(trainer, batches[2:3])  # node 2 heals at the end of step 2
    for a, b in zip(_state(trainer.copies[0]), _state(trainer.copies[2])):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    helpers.run_batches(trainer, batches[3:])
    live_only = [(x, y) if s not in (1, 2) else (np.delete(x, range(8, 12), 0),
                                                 np.delete(y, range(8, 12), 0))
                 for s, (x, y) in enumerate(batches)]
    one_device = dataclasses.replace(config, node_failures=None)  # (one device: no nodes)
    weights, _, bound = helpers.train_reference_bounded(one_device, live_only)
    for copy in helpers.copy_weights(trainer):
        tolerance.assert_within(copy, weights, bound.weights())
    everyone = helpers.train_reference(one_device, batches)[0]  # the test can fail: a node left
    assert any(np.any(np.abs(a - e) > 10 * t) for a, e, t in  # in differs far beyond it
               zip(helpers.copy_weights(trainer)[0], everyone, bound.weights()))

    traffic, node2 = trainer.aggregation.traffic, devices.canonical(trainer.tower_devices[2])
    healing = traffic.of_occasion("node 2 returns").received[node2]  # its state, at step 2
    assert healing >= sum(v.shape.num_elements() * 4 for v in _state(trainer.copies[0]))
    for s in range(5):
        down = s in (1, 2)
        moved = traffic.at_step(s)
        assert (moved.sent.get(node2, 0) == 0) == down
        assert moved.received.get(node2, 0) == (
            healing if s == 2 else 0 if down else traffic.at_step(0).received[node2])
    size = sum(v.shape.num_elements() * 4 for v in trainer.copies[0].trainable)
    for live, name in ((4, "nodes 0,1,2,3 live"), (3, "nodes 0,1,3 live")):
        ring = traffic.of_occasion(name).sent  # a ring of L nodes: 2 (L-1)/L of the gradient
        assert len(ring) == live and all(abs(sent - 2 * (live - 1) / live * size) <= 8 * live
                                         for sent in ring.values())


def _state(copy):
    return list(copy.trainable) + list(copy.optimizer.variables)


# ---- 2. DiLoCo, op for op ----
PERIOD, LR, MU, OUTER_LR, OUTER_MU = 3, 0.125, 0.5, 0.5, 0.5
SPEC = f"diloco:period={PERIOD},outer_lr={OUTER_LR},outer_momentum={OUTER_MU}"
FAILURES = "2@2-4,1@6"  # node 2 down at the sync of step 2 and step 3, back at 4; 1 gone at 6
STEPS = 9  # syncs after steps 2 (nodes 0, 1), 5 (all three), 8 (nodes 0, 2)


def numpy_diloco(w0, grads, schedule):
    """The rule, op for op, in float64: inner momentum SGD (Keras: m <- mu m - lr g,
    w <- w + m) on live copies only; at a sync a = mean of the live copies, delta = x - a,
    M <- mu' M + delta, x <- x - lr' (delta + mu' M) (nesterov), live copies take x; a node
    returning at b takes node 0's copy, slot, x and M at the end of step b - 1.
    Returns the per-node (w, slot, x, M) and the largest magnitude met."""
    n = len(grads[0])
    w, slot = [w0.copy() for _ in range(n)], [np.zeros_like(w0) for _ in range(n)]
    x, big = [w0.copy() for _ in range(n)], [np.zeros_like(w0) for _ in range(n)]
    largest = np.abs(w0).max()
    for s, per_node in enumerate(grads):
        live = [schedule.live(c, s) for c in range(n)]
        for c in range(n):
            if live[c]:
                slot[c] = MU * slot[c] - LR * per_node[c]
                w[c] = w[c] + slot[c]
        if (s + 1) % PERIOD == 0:
            a = sum(w[c] for c in range(n) if live[c]) / sum(live)
            for c in range(n):
                if live[c]:
                    delta = x[c] - a
                    big[c] = OUTER_MU * big[c] + delta
                    x[c] = x[c] - OUTER_LR * (delta + OUTER_MU * big[c])
                    w[c] = x[c].copy()
        for node, back, source in schedule.returns():
            if s + 1 == back:
                w[node], slot[node] = w[source].copy(), slot[source].copy()
                x[node], big[node] = x[source].copy(), big[source].copy()
        largest = max(largest, *(np.abs(v).max() for v in w + slot + x + big))
    return w, slot, x, big, largest


def test_diloco_with_a_node_down_mid_period_follows_the_rule_op_for_op():
    """Hand-made dyadic gradients (k/16) on a 3x2 kernel, so every inner value is exact in
    float32; only the live means (one division by |L|) and the outer step round. The
    gradients do not depend on the weights, so a rounding is carried on by linear maps
    of norm <= 3 per sync; 3 syncs of <= 8 roundings of <= u M each (M the largest
    magnitude): |mgloop - model| <= 8 u M (1 + 3 + 9 + 27). One traced step serves
    every step (the live set is read from the step counter)."""
    config = helpers.small_config(None, devices="cpu:3", nodes=3, aggregation=SPEC,
                                  optimizer="momentum", learning_rate=LR, momentum=MU,
                                  node_failures=FAILURES, train_steps=STEPS,
                                  global_batch_size=12).validated(False)
    method, failures = method_at_nodes(config)
    rng = np.random.default_rng(5)
    w0 = (rng.integers(-15, 16, size=(3, 2)) / 8.0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, use_bias=False)])
    model.layers[0].kernel.assign(w0.astype(np.float32))
    replicas = Replicas(model, method,
                        lambda: optim.make_optimizer(config.optim, config.train_steps))
    hook = hook_for(method.failures, replicas)
    grads = rng.integers(-15, 16, size=(STEPS, 3, 3, 2)) / 16.0

    @tf.function(input_signature=[tf.TensorSpec((3, 3, 2), tf.float32)])
    def step(per_copy):
        with method.step():
            replicas.apply([[per_copy[c]] for c in range(3)], [[], [], []],
                           hook.may_apply(None))
            kept = method.after_update(replicas.copies)
        replicas.advance(also=kept)

    returned = None
    for s in range(STEPS):
        step(tf.constant(grads[s], tf.float32))
        if s + 1 == 4:  # node 2 is back: its copy is node 0's, the live model
            returned = [v.numpy() for v in _state(replicas.copies[2])]
            for a, b in zip(_state(replicas.copies[0]), returned):
                np.testing.assert_array_equal(a.numpy(), b)
    assert step.experimental_get_tracing_count() == 1
    schedule = method.failures
    w, slot, x, big, largest = numpy_diloco(w0, grads, schedule)
    bound = 8 * tolerance.U * largest * (1 + 3 + 9 + 27)
    for c, copy in enumerate(replicas.copies):
        np.testing.assert_allclose(copy.trainable[0].numpy(), w[c], rtol=0, atol=bound)
        momentum_slot = optim_slots(copy)[0]
        np.testing.assert_allclose(momentum_slot, slot[c], rtol=0, atol=bound)
        start, outer = method.inner.copy_state(c)
        np.testing.assert_allclose(start.numpy(), x[c], rtol=0, atol=bound)
        np.testing.assert_allclose(outer.numpy(), big[c], rtol=0, atol=bound)
    nobody_fails = node_failures.Schedule(3, (), STEPS)  # the test can fail: the rule without
    w_all = numpy_diloco(w0, grads, nobody_fails)[0]  # failures lies far from it
    assert np.abs(w_all[0] - w[0]).max() > 1000 * bound
    names = [o.name for o in method.traffic.occasions()]
    assert "node 2 returns" in names and method.traffic.of_occasion("node 2 returns").sent


def optim_slots(copy):
    return [v.numpy() for v in slot_variables(copy.optimizer)]


# ---- 3. refusals ----
REFUSALS = [
    (dict(nodes=4, aggregation="ring", node_failures="4@1-3"), "node 4 is out of range"),
    (dict(nodes=4, aggregation="ring", node_failures="0@1-3"), "node 0 is out of range"),
    (dict(nodes=4, aggregation="ring", node_failures="2@3-2"), "out of range: steps"),
    (dict(nodes=4, aggregation="ring", node_failures="2@5"), "out of range: steps"),
    (dict(nodes=4, aggregation="ring", node_failures="2@1-3,2@2-4"), "overlap"),
    (dict(nodes=4, aggregation="ring", node_failures="2@1,2@3-4"), "overlap"),
    (dict(nodes=4, aggregation="ring", node_failures="2:1-3"), "is not n@a-b or n@a"),
    (dict(nodes=4, aggregation="ring", node_failures=""),  # not "no failures": left out is
     "--node_failures is set but empty; give n@a-b or n@a items"),
    (dict(node_failures=" "), "or leave --node_failures out for no failures"),
    (dict(nodes=1, aggregation="ring", node_failures="1@1"), "needs simulated nodes"),
    (dict(nodes=4, method_at="towers", aggregation="ring", node_failures="1@1"),
     "needs simulated nodes"),
    (dict(nodes=4, aggregation="topk:ratio=0.5", node_failures="1@1"), "use one of: "),
    (dict(nodes=4, aggregation="streaming_diloco", node_failures="1@1"), "use one of: "),
    (dict(nodes=4, aggregation="hierarchical:groups=2", node_failures="1@1-3"),
     "with nodes (0, 2, 3) live"),
    (dict(nodes=4, aggregation="ring", grad_reduce="sum", node_failures="1@1"),
     "--grad_reduce=mean"),
]


@pytest.mark.parametrize("settings, message", REFUSALS)
def test_bad_failure_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ConfigError) as error:
        helpers.small_config(None, devices="cpu:4", **settings).validated(False)
    text = str(error.value)
    assert "\n" not in text and message in text and "--node_failures" in text


def test_between_real_workers_the_refusal_points_at_the_elastic_launch():
    class TwoWorkers:
        num_workers = 2
    config = helpers.small_config(None, devices="cpu:1", aggregation="ring",
                                  node_failures="1@1")
    with pytest.raises(ConfigError, match="mgloop.launch --elastic"):
        node_failures.check_schedule(config.exchange, config.train_steps,
                                     settings.Context(workers=TwoWorkers(), num_workers=2))


def test_the_schedule_of_a_spec():
    schedule = node_failures.Schedule.parse("2@30-60,1@80", 4, 100)
    assert [schedule.live(2, s) for s in (29, 30, 59, 60)] == [True, False, False, True]
    assert not schedule.live(1, 99) and schedule.live(1, 79)
    assert schedule.returns() == [(2, 60, 0)]
    assert schedule.events() == [(30, 2, "leaves"), (60, 2, "returns"), (80, 1, "leaves")]
    assert schedule.sets() == [(0, 1, 2, 3), (0, 1, 3), (0, 2, 3)]
    for step in (0, 29, 30, 59, 60, 79, 80, 99):  # the step counter's tensor and an int agree
        index = schedule.set_index(step)
        assert int(schedule.set_index(tf.constant(step, tf.int64))) == index
        assert schedule.sets()[index] == tuple(n for n in range(4) if schedule.live(n, step))
        assert bool(schedule.alive(2, tf.constant(step, tf.int64))) == schedule.live(2, step)
    occasion = schedule.occasion(1)
    assert occasion.name == "nodes 0,1,3 live" and occasion.occurs(45) and not occasion.occurs(60)
