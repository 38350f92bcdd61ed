"""--towers_per_device=K: a device's K towers as one vectorized computation
(mgloop/step/vectorized_towers.py) equal the tower loop with the same towers.

1. Against one device (mean methods): K towers on D devices train what one device trains
   on the global batch, within tests/tolerance.py's bound (as test_equivalence.py).
2. Against the tower loop, per tower, with dropout and batch norm in the model: the model
   is x -> BatchNormalization -> Dropout(1/2) -> Dense with an identity kernel, so a
   tower's outputs are its shard's normalised inputs times its dropout mask / (1 - rate).
   The vectorized pass and the tower loop (per_tower.group_pass) run on the same shards in
   one traced function; each tower's outputs (read through a metric whose state is the
   outputs) must have exactly the same zeros (the same dropout masks: the same random
   streams) and, elsewhere, both lie within a derived bound of the exact float64 value of
   batch norm on that tower's shard (its own batch statistics):
       mu = (1/b) sum_i x_i (error <= gamma(b) A, A = (1/b) sum_i |x_i|),
       v = (1/b) sum_i (x_i - mu)^2 (two-pass; error <= gamma(b + 3) V1 with
           V1 = (1/b) sum_i (|x_i - mu| + gamma(b) A)^2),
       out_i = 2 (x_i - mu) / sqrt(v + eps): |d out_i| <= 2 [gamma(b) A + u |x_i - mu|
           + |x_i - mu| (gamma(b + 3) V1 / (2 (v + eps)) + 3 u)] / sqrt(v + eps),
   doubled for the second-order terms. The kernel's gradient of the loss
   (1/(b F)) sum_{i,k} out_ik c_k is (1/(b F)) sum_i h_ij c_k (h: the Dense's input, out
   before the identity), so the two passes' gradients lie within
   (1/(b F)) sum_i (|d h_ij| + gamma(b + 1) |h_ij|) |c_k| of the exact one.
3. Methods: a robust rule (median) and a compressor (top-k with error feedback, per-tower
   memories) on one device of 4 towers equal the tower loop on 4 devices within the
   bound of 1. carried through the rule (the median is 1-Lipschitz per element in the
   largest change of a tower's gradient; every tower's gradient moves by at most the
   bound of its shard) and, for top-k at ratio 1 (lossless: every element kept), against
   one device; nodes (2 nodes of 2 towers on 2 devices) against the tower loop's nodes.
4. Refusals, before anything is built, and the layer pfor cannot vectorize, named.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from mgloop.cluster import devices
from mgloop.runs import experiment
from mgloop.step import per_tower, pfor, vectorized_towers
from mgloop.errors import ConfigError
from tests import helpers
from tests import tolerance

STEPS = 5
U = tolerance.U
gamma = tolerance.gamma


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(config):
        key = (config.model, config.optimizer, config.accumulation_steps)
        if key not in cache:
            cache[key] = helpers.train_reference_bounded(config, helpers.batches(STEPS))
        return cache[key]
    return get


@pytest.mark.parametrize("mode,num_devices,k,micro", [("ps_cpu", 1, 4, 1), ("ring", 2, 2, 1),
                                                     ("ps_cpu", 2, 2, 2)])
def test_vectorized_towers_equal_one_device(mode, num_devices, k, micro, reference, logdir):
    """micro = 2: --accumulation_steps=2 (each tower's state carried between micro-batches,
    mapped per tower by the vectorized pass)."""
    config = helpers.small_config(logdir, devices=f"cpu:{num_devices}", towers_per_device=k,
                                  aggregation=mode, accumulation_steps=micro)
    trainer, _ = helpers.train_mgloop(config, helpers.batches(STEPS))
    assert trainer.replicas.num_towers == num_devices * k
    # one copy per device (replicated) or one in all (shared)
    assert len(trainer.copies) == (num_devices if mode == "ring" else 1)
    for weights in helpers.copy_weights(trainer):
        tolerance.assert_matches_reference(weights, None, reference(config))


# --- 2. dropout and batch norm, per tower, against the tower loop ------------------------

FEATURES, RATE, EPS = 8, 0.5, 1e-3


def dropout_bn_model():
    inputs = keras.Input((FEATURES,))
    normalised = keras.layers.BatchNormalization(epsilon=EPS)(inputs)
    dropped = keras.layers.Dropout(RATE)(normalised)
    outputs = keras.layers.Dense(FEATURES, use_bias=False,
                                 kernel_initializer="identity")(dropped)
    return keras.Model(inputs, outputs)


class Outputs:
    """A metric whose state is the shard's outputs, flattened (to read them per tower)."""

    def __init__(self, rows: int):
        self.name, self.size = "outputs", rows * FEATURES

    def counts(self, y, outputs):
        return tf.reshape(outputs, [-1])

    def result(self, sums):
        return None


WEIGHTS = np.linspace(-1.0, 1.0, FEATURES).astype(np.float32)  # c_k of the loss


def weighted_loss(y, outputs):
    return tf.reduce_mean(outputs * WEIGHTS, axis=-1)


def bn_bound(x: np.ndarray):
    """(exact normalised shard 2 (x - mu) / sqrt(v + eps), the bound of the docstring)."""
    x = x.astype(np.float64)
    b = len(x)
    mu = x.mean(0)
    v = ((x - mu) ** 2).mean(0)
    a = np.abs(x).mean(0)
    v1 = ((np.abs(x - mu) + gamma(b) * a) ** 2).mean(0)
    d = np.abs(x - mu)
    scale = 1 / (1 - RATE) / np.sqrt(v + EPS)
    bound = scale * (gamma(b) * a + U * d + d * (gamma(b + 3) * v1 / (2 * (v + EPS)) + 3 * U))
    return (x - mu) * scale, 2 * bound


def test_dropout_and_batch_norm_per_tower_equal_the_tower_loop(logdir):
    k, rows = 4, 4
    config = helpers.small_config(logdir, devices="cpu:1", towers_per_device=k,
                                  global_batch_size=k * rows, optimizer="sgd").validated()
    device_set = devices.setup(devices.parse(config.devices, config.towers_per_device))
    trainer = experiment.build_trainer(config, device_set, dropout_bn_model, weighted_loss,
                                       (FEATURES,), metrics=[Outputs(rows)])
    step = trainer.step
    x = np.random.default_rng(5).normal(1.0, 2.0, (k, rows, FEATURES)).astype(np.float32)
    y = np.zeros((k, rows), np.int32)

    @tf.function
    def both():
        trainable, state = step.replicas.read_for_tower(0)
        xs, ys = list(tf.unstack(x)), list(tf.unstack(y))
        vectorized = vectorized_towers.device_pass(step, range(k), trainable, [state] * k,
                                                   xs, ys)
        loop = per_tower.group_pass(step, range(k), trainable, [state] * k, xs, ys)
        return [[(o.metric_state, o.grads[2]) for o in out] for out in (vectorized, loop)]
    vectorized, loop = both()
    masks = []
    for t in range(k):
        exact, bound = bn_bound(x[t])
        for outputs, kernel_grad in (vectorized[t], loop[t]):
            out = outputs.numpy().reshape(rows, FEATURES)
            kept = out != 0
            masks.append(kept)
            np.testing.assert_array_less(np.abs(out - exact)[kept], bound[kept] + 1e-30)
            h = np.where(kept, exact, 0.0)
            grad_exact = h.T @ np.tile(WEIGHTS, (rows, 1)) / (rows * FEATURES)
            grad_bound = ((np.where(kept, bound, 0.0) + gamma(rows + 1) * np.abs(h)).T
                          @ np.tile(np.abs(WEIGHTS), (rows, 1))) / (rows * FEATURES)
            assert np.all(np.abs(kernel_grad.numpy() - grad_exact) <= 2 * grad_bound + 1e-30)
        assert np.array_equal(masks[-2], masks[-1])  # the same dropout mask, exactly
    # the towers drew different masks (independent streams), and about half is dropped
    assert not all(np.array_equal(masks[0], m) for m in masks[2::2])
    assert 0.2 < np.mean(masks) < 0.8


# --- 3. methods against the tower loop ----------------------------------------------------

def train_stepwise(config, steps_batches, bound_of=None):
    """Trains one step at a time; `bound_of(trainer, x, y)` after each step's batch is
    known (before it runs) returns that step's gradient bound, summed into the result."""
    trainer = helpers.build_trainer(config)
    total = None
    for x, y in steps_batches:
        if bound_of is not None:
            step_bound = bound_of(trainer, x, y)
            total = step_bound if total is None else total + step_bound
        helpers.run_batches(trainer, [(x, y)])
    return trainer, total


def shard_gradient_bound(trainer, x, y, towers_count):
    """max over towers of the shards' gradient bounds (tolerance.gradient_bound) at the
    trainer's weights: how far any tower's gradient may move between two summation
    orders, so how far a 1-Lipschitz rule of them may."""
    model = trainer.model
    bounds = [tolerance.gradient_bound(model, experiment.default_loss(), xs, ys)[0]
              for xs, ys in zip(np.split(x, towers_count), np.split(y, towers_count))]
    return np.max(bounds, axis=0)


@pytest.mark.parametrize("spec,memory_steps,attack", [
    ("median", 1, {}), ("median", 1, dict(byzantine_towers=1, attack="signflip:factor=10")),
    ("randomk:ratio=0.25,memory=residual", 3, {})])
def test_methods_on_vectorized_towers_equal_the_tower_loop(spec, memory_steps, attack, logdir):
    """The median (with and without a sign-flipping tower: the attack alters the tower's
    row after the vectorized pass, exactly as after its own pass), and random-k with error
    feedback (every tower's memory e_t kept apart on the shared device; its seeded
    positions do not depend on the values, so its output is a linear map of
    x_t = g_t + e_t: a difference in a memory is carried into every later step, at most
    `memory_steps` = 3 steps' bounds in all), over 3 steps. The attacker's factor of 10
    scales its bound likewise, within the largest tower's bound times 10."""
    settings = dict(aggregation=spec, optimizer="sgd", learning_rate=0.1, **attack)
    batches = helpers.batches(3)
    loop_config = helpers.small_config(logdir + "_loop", devices="cpu:4", **settings)
    lr = loop_config.learning_rate
    factor = 10.0 if attack else 1.0
    loop, bound = train_stepwise(
        loop_config, batches, lambda tr, x, y: factor * lr * shard_gradient_bound(tr, x, y, 4))
    vectorized, _ = train_stepwise(helpers.small_config(
        logdir, devices="cpu:1", towers_per_device=4, **settings), batches)
    if memory_steps > 1:  # four memories, one per tower, on the one device
        memories = vectorized.aggregation.state_variables
        assert len({m.device for m in memories}) == 1 and len(memories) % 4 == 0
    a, b, start = (np.concatenate([w.ravel() for w in weights]) for weights in (
        helpers.copy_weights(loop)[0], helpers.copy_weights(vectorized)[0],
        helpers.copy_weights(helpers.build_trainer(loop_config))[0]))
    assert np.abs(a - start).max() > 100 * bound.max()  # trained far beyond the bound
    np.testing.assert_array_less(np.abs(a - b),
                                 tolerance.FEEDBACK * memory_steps * bound + 1e-12)


def test_lossless_compressor_on_vectorized_towers_equals_one_device(reference, logdir):
    config = helpers.small_config(logdir, devices="cpu:1", towers_per_device=4,
                                  aggregation="topk:ratio=1")
    trainer, _ = helpers.train_mgloop(config, helpers.batches(STEPS))
    assert len(trainer.aggregation.inner.state_variables) > 0  # per-tower memories
    tolerance.assert_matches_reference(helpers.copy_weights(trainer)[0], None,
                                       reference(config))


def test_nodes_of_vectorized_towers_equal_the_tower_loop_nodes(reference, logdir):
    """2 nodes of 2 towers, the exact mean between them (ring at the nodes): one device.
    and local SGD with period 1 (its identity): one device again, through the per-node
    copies the method keeps (copies_differ)."""
    for spec in ("ring", "localsgd:period=1"):
        config = helpers.small_config(f"{logdir}_{spec}", devices="cpu:2",
                                      towers_per_device=2, nodes=2, aggregation=spec)
        trainer, _ = helpers.train_mgloop(config, helpers.batches(STEPS))
        assert len(trainer.copies) == 2
        for weights in helpers.copy_weights(trainer):
            tolerance.assert_matches_reference(weights, None, reference(config))


# --- 4. refusals ----------------------------------------------------------------------------

@pytest.mark.parametrize("settings,words", [
    (dict(towers_per_device=0), "towers_per_device"),
    (dict(devices="cpu:1", towers_per_device=4, aggregation="localsgd"), "one variable copy"),
    (dict(devices="cpu:1", towers_per_device=4, aggregation="delay:d=1"), "stale"),
    (dict(devices="cpu:1", towers_per_device=4, aggregation="colocate"), "one loss"),
    (dict(devices="cpu:1", towers_per_device=4, aggregation="drop:choose=arrival",
          deterministic=False),
     "finish together"),
    (dict(devices="cpu:1", towers_per_device=4, aggregation="independent"), "own"),
    (dict(devices="cpu:2", towers_per_device=2, aggregation="topk:ratio=0.1"),
     "per receiving tower"),
    (dict(devices="cpu:1", towers_per_device=4, byzantine_towers=1, attack="labelflip"),
     "labelflip"),
    (dict(devices="cpu:1", towers_per_device=4, batch_norm="sync"), "batch_norm=sync"),
    (dict(devices="cpu:1", towers_per_device=4, mixed_precision="mixed_float16"),
     "mixed_float16"),
    (dict(devices="cpu:1", towers_per_device=4, nodes=2, aggregation="median"),
     "whole devices"),
    (dict(devices="cpu:2", towers_per_device=2, aggregation="hierarchical:groups=4"),
     "runs between the 2 devices"),
])
def test_refused_before_building(settings, words, logdir):
    config = helpers.small_config(logdir, **settings)
    with pytest.raises(ConfigError) as error:
        config.validated()
    assert words in str(error.value) and "\n" not in str(error.value)


class CTCLayer(keras.layers.Layer):
    """A layer whose op (the CTC loss) pfor cannot vectorize, even by a loop."""

    def call(self, x):
        batch = tf.shape(x)[0]
        logits = tf.reshape(x, [-1, 2, 2])
        loss = tf.nn.ctc_loss(tf.ones([batch, 1], tf.int32), logits,
                              tf.ones([batch], tf.int32), tf.fill([batch], 2),
                              logits_time_major=False, blank_index=0)
        return x + tf.reduce_sum(loss)

    def compute_output_shape(self, shape):
        return shape


def test_a_layer_that_cannot_be_vectorized_is_named_before_any_copy():
    model = keras.Sequential([keras.Input([4]), CTCLayer(name="ctc"), keras.layers.Dense(2)])
    with pytest.raises(ConfigError) as error:
        pfor.probe(model, (4,))
    assert "layer 'ctc'" in str(error.value) and "--towers_per_device=1" in str(error.value)
    pfor.probe(dropout_bn_model(), (FEATURES,))  # a vectorizable model passes
