"""`des_loc` (aggregation/local/des_loc.py): local Adam whose parameters, first moment and second
moment are averaged across the nodes, each on its own period.

1. The method through mgloop's own replicas (each copy's Keras Adam, `after_update`, one
   traced step) against the float64 numpy model of itself (tests/des_loc_model.py) on
   hand-made gradients between 4 nodes, within the model's stated first-order bound; with
   node 2 down for three steps too (node failures: syncs among the live nodes, a return
   takes node 0's x, m, v and step count).
2. The paper's toy problem (Rosenbrock, many workers, Gaussian gradient noise) in the
   numpy model.
3. Every period 1 is `localsgd:period=1,slots=average`, bit for bit (2 towers).
4. The bytes of each sync and per step on average, at --nodes=4 on the mlp, by hand.
5. Between 2 nodes of 2 towers a node's copies and their Adam slots stay equal.
6. A resume mid-period equals an uninterrupted run, bit for bit.
7. The refusals, one line each.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import mgloop
from mgloop import aggregation
from mgloop.aggregation.local.des_loc import DesLoc
from mgloop.cluster import devices
from mgloop.errors import ConfigError
from mgloop.step.hooks.node_failures import hook_for
from mgloop.step.replicas import Replicas, global_step_on
from mgloop.training import optim
from tests import helpers
from tests.copies_by_hand import method_at_nodes
from tests.des_loc_model import NumpyDesLoc, rosenbrock, rosenbrock_gradient
from tests.test_local_steps import checkpoint_tensors

PERIODS = (2, 3, 5)  # x after steps 1, 3, 5, 7, 9; m after 2, 5, 8; v after 4, 9
SPEC = "des_loc:period=2,momentum_period=3,variance_period=5"
LR, EPS, STEPS = 0.01, 1e-3, 10


def adam_state(copy):
    """x, m, v of a copy (its one Dense layer's kernel and bias), as numpy."""
    opt = copy.optimizer
    return ([v.numpy() for v in copy.trainable], [v.numpy() for v in opt._momentums],
            [v.numpy() for v in opt._velocities])


# ---- 1. against the numpy model ----
@pytest.mark.parametrize("failures", [None, "2@3-6"])
def test_equals_the_numpy_model_within_its_bound(failures):
    """4 nodes of one tower, a Dense(2) on 3 inputs (kernel and bias), Adam (lr 0.01, eps
    1e-3), 10 steps of seeded N(0, 1) gradients per node (not functions of the weights:
    no error feeds back). After every step each node's x, m and v lie within twice the
    model's first-order float32 bound (tests/des_loc_model.py) of the float64 model; right
    after a sync of q every live node holds the same bits of q; between syncs the nodes'
    q differ by over 100 times the bound (a missed or misplaced sync fails). With node 2
    down for steps 3, 4, 5: its state is frozen, the syncs at steps 3, 4, 5 average the
    live nodes 0, 1, 3, and at the end of step 5 it takes node 0's x, m, v, step count."""
    config = helpers.small_config(None, devices="cpu:4", nodes=4, aggregation=SPEC,
                                  optimizer="adam", learning_rate=LR, adam_epsilon=EPS,
                                  node_failures=failures, train_steps=STEPS,
                                  global_batch_size=16).validated(False)
    method, schedule = method_at_nodes(config)
    assert isinstance(method.inner, DesLoc)
    tf.random.set_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    init = [v.numpy() for v in model.trainable_variables]
    replicas = Replicas(model, method,
                        lambda: optim.make_optimizer(config.optim, config.train_steps))
    hook = hook_for(schedule, replicas)
    guard = hook.may_apply(None) if hook else (lambda c, update: update())

    @tf.function(input_signature=[tf.TensorSpec((4, 3, 2)), tf.TensorSpec((4, 2))])
    def step(kernels, biases):
        with method.step():
            replicas.apply([[kernels[c], biases[c]] for c in range(4)], [[]] * 4, guard)
            kept = method.after_update(replicas.copies)
        replicas.advance(also=kept)

    rng = np.random.default_rng(7)
    numpy_model = NumpyDesLoc(init, 4, PERIODS, LR, EPS)
    apart = {"x": 0.0, "m": 0.0, "v": 0.0}
    for s in range(STEPS):
        grads = [rng.standard_normal((4, 3, 2)).astype(np.float32),
                 rng.standard_normal((4, 2)).astype(np.float32)]
        live = [schedule is None or schedule.live(c, s) for c in range(4)]
        step(tf.constant(grads[0]), tf.constant(grads[1]))
        numpy_model.step(s, grads, live)
        for node, back, source in (schedule.returns() if schedule else ()):
            if s + 1 == back:
                numpy_model.take(node, source)
        for c, copy in enumerate(replicas.copies):
            got = adam_state(copy)
            for name, values, want, bound in zip("xmv", got, (numpy_model.x, numpy_model.m,
                                                             numpy_model.v),
                                                 (numpy_model.ex, numpy_model.em,
                                                  numpy_model.ev)):
                for i, value in enumerate(values):
                    error = np.abs(value - want[i][c])
                    assert np.all(error <= 2 * bound[i][c]), (s, c, name, i, error.max())
        for name, period, index in (("x", PERIODS[0], 0), ("m", PERIODS[1], 1),
                                    ("v", PERIODS[2], 2)):
            values = [adam_state(copy)[index] for copy, up in zip(replicas.copies, live) if up]
            if (s + 1) % period == 0:  # the live nodes hold the same bits
                for other in values[1:]:
                    for a, b in zip(values[0], other):
                        np.testing.assert_array_equal(a, b, err_msg=f"{name} after step {s}")
            else:
                spread = max(np.abs(a - b).max() for other in values[1:]
                             for a, b in zip(values[0], other))
                apart[name] = max(apart[name], spread)
    for name, bound in zip("xmv", (numpy_model.ex, numpy_model.em, numpy_model.ev)):
        largest = max(2 * b.max() for b in bound)
        assert apart[name] > 100 * largest, (name, apart[name], largest)
    assert step.experimental_get_tracing_count() == 1
    occasions = [o.name for o in method.traffic.occasions()]
    assert {"parameters", "first moment", "second moment"} <= {n.split(",")[0]
                                                               for n in occasions}


# ---- 2. the paper's toy problem ----
def rosenbrock_run(mode, seed, workers=64, steps=2000, lr=0.05, sigma=1.5,
                   periods=(16, 48, 96)):
    """f at the workers' mean after every step: Adam (eps 1e-8) from (-1, 1) on each of
    `workers` workers, each gradient with N(0, sigma^2) noise of its own."""
    rng = np.random.default_rng(seed)
    model = NumpyDesLoc([np.array([-1.0, 1.0])], workers, periods, lr, 1e-8, mode=mode,
                        bound=False)
    out = np.empty(steps)
    for s in range(steps):
        x = model.x[0]
        model.step(s, [rosenbrock_gradient(x) + sigma * rng.standard_normal(x.shape)])
        out[s] = rosenbrock(model.x[0].mean(0))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_the_papers_toy_problem(seed):
    """Rosenbrock f(x) = (1 - x1)^2 + 100 (x2 - x1^2)^2 from f = 4, 64 workers, noise
    sigma = 1.5 (the paper's; it has 256 workers), K = 16, 48, 96, lr 0.05, 2000 steps:
    over the last 500 steps DES-LOC's f stays below 1e-3 on average and 1e-2 at most
    (measured on seeds 0..9: at most 5.5e-4 and 3.6e-3), while resetting m, v (and Adam's
    step count) at every parameter sync oscillates: its average above 0.1, its peaks
    above 0.5 (measured: at least 0.21 and 1.2). Keeping the moments local (parameters
    averaged alone), which the paper's figure shows oscillating too, converges here as
    DES-LOC does (measured: at most 5.5e-4 on average): asserted, as what this model
    gives. About 0.1 s a run."""
    last = {mode: rosenbrock_run(mode, seed)[-500:] for mode in ("des_loc", "reset", "local")}
    assert last["des_loc"].mean() < 1e-3 and last["des_loc"].max() < 1e-2
    assert last["reset"].mean() > 0.1 and last["reset"].max() > 0.5
    assert last["local"].mean() < 1e-3


# ---- 3. every period 1 ----
def trained(tmp_path, spec, towers, steps=4):
    """(the trainer of `spec` after `steps` batches, copy 0's weights before them)."""
    config = helpers.small_config(str(tmp_path / spec.split(":")[0]), devices=f"cpu:{towers}",
                                  aggregation=spec, optimizer="adam", adam_epsilon=EPS,
                                  learning_rate=0.01)
    trainer = helpers.build_trainer(config)
    start = helpers.copy_weights(trainer)[0]
    helpers.run_batches(trainer, helpers.batches(steps))
    return trainer, start


def test_every_period_one_is_localsgd_averaging_its_slots_bit_for_bit(tmp_path):
    """des_loc:period=1,momentum_period=1,variance_period=1 and
    localsgd:period=1,slots=average on 2 towers, 4 steps: every copy's weights, m, v and
    step count equal bit for bit (the same means: on 2 copies each ring sum is one
    addition, whatever the vector it is cut from). It is not synchronous Adam: the mean
    of the nodes' Adam steps is not the step of the mean gradient (module docstring)."""
    ones, start = trained(tmp_path, "des_loc:period=1,momentum_period=1,variance_period=1", 2)
    local, _ = trained(tmp_path, "localsgd:period=1,slots=average", 2)
    assert np.abs(helpers.copy_weights(ones)[0][0] - start[0]).max() > 1e-3
    for a, b in zip(ones.copies, local.copies):
        for x, y in zip(a.variables + a.optimizer.variables, b.variables + b.optimizer.variables):
            np.testing.assert_array_equal(x.numpy(), y.numpy())


# ---- 4. bytes ----
def ring_bytes(elements, towers, element_bytes=4):
    """Bytes each tower sends in the ring all-reduce of `elements` (tests/test_sparta.py)."""
    base, extra = divmod(elements, towers)
    size = [base + (c < extra) for c in range(towers)]
    return [(2 * elements - size[(t + 1) % towers] - size[(t + 2) % towers]) * element_bytes
            for t in range(towers)]


def test_bytes_per_sync_and_per_step_by_hand(tmp_path):
    """--nodes=4 of one tower, the mlp of two hidden layers (192 -> 128 -> 128 -> 10: P = 42506 parameters),
    des_loc:period=2,momentum_period=4,variance_period=8 over 8 steps (x synced 4 times,
    m 2, v once). Each sync is a float32 ring of P elements among the 4 nodes: the busiest
    node sends 2P - (two chunks of 10626) = 63760 elements, 255040 bytes, in 6 messages,
    whatever it carries (m and v have the parameters' shapes); per step on average
    (4 + 2 + 1)/8 of it, 223160 bytes. No gradient ever travels."""
    summary = mgloop.run(helpers.small_config(
        str(tmp_path), devices="cpu:4", nodes=4, mlp_depth=2, optimizer="adam", train_steps=8,
        steps_per_loop=8, aggregation="des_loc:period=2,momentum_period=4,variance_period=8",
        links=("within:100gbit,2us", "between:1gbit,50us")))
    report = summary["link_model"]
    assert report["where"] == "between nodes"
    busiest = max(ring_bytes(42506, 4))
    assert busiest == 255040
    for name, times in (("parameters", 4), ("first moment", 2), ("second moment", 1)):
        sync = report["syncs"][name]
        assert sync["occurrences"] == times
        assert sync["gradient_bytes_per_device"] == busiest == sync["bytes_per_device"]
        assert sync["messages_per_device"] == 6
    assert set(report["syncs"]) == {"parameters", "first moment", "second moment"}
    assert report["gradient_bytes_per_step"] == pytest.approx(busiest * 7 / 8, rel=1e-12)


# ---- 5. between nodes of several towers ----
def test_between_two_nodes_a_nodes_copies_and_slots_stay_equal(tmp_path):
    """2 nodes of 2 towers, periods 2, 3, 5, 6 steps: after every step the two copies of a
    node hold the same bits of x, m and v (the leader's sync handed to the other tower:
    each sync hands what it changed); between the nodes x is equal exactly after the
    steps that sync it (1, 3, 5), m after 2 and 5, v after 4."""
    config = helpers.small_config(str(tmp_path), devices="cpu:4", nodes=2, aggregation=SPEC,
                                  optimizer="adam", adam_epsilon=EPS, learning_rate=0.01)
    trainer = helpers.build_trainer(config)
    for s, batch in enumerate(helpers.batches(6)):
        helpers.run_batches(trainer, [batch])
        state = [adam_state(copy) for copy in trainer.copies]
        for a, b in ((0, 1), (2, 3)):
            for x, y in zip(sum(state[a], []), sum(state[b], [])):
                np.testing.assert_array_equal(x, y, err_msg=f"step {s}")
        for index, period in enumerate(PERIODS):
            equal = all(np.array_equal(x, y) for x, y in zip(state[0][index], state[2][index]))
            assert equal == ((s + 1) % period == 0), (s, "xmv"[index])


# ---- 6. resume ----
def test_resume_mid_period_is_bit_identical(tmp_path):
    """mgloop.run on 2 towers, periods 2, 3, 5: 6 steps straight equal 3 steps (a
    checkpoint between syncs of m and v, the copies apart) then a resumed run to 6, bit for
    bit under --deterministic: every tensor of the last checkpoint (every copy, its Adam's
    m, v and step count, the global step)."""
    def run(name, steps):
        return mgloop.run(helpers.small_config(
            str(tmp_path / name), devices="cpu:2", aggregation=SPEC, optimizer="adam",
            train_steps=steps, steps_per_loop=3, checkpoint_every=0, eval_every=0))
    run("straight", 6)
    assert run("resumed", 3)["final_step"] == 3
    assert run("resumed", 6)["start_step"] == 3
    straight, resumed = (checkpoint_tensors(tmp_path / n) for n in ("straight", "resumed"))
    # copy 1 beside copy 0: the mlp's 4 weights, its Adam's step count and 4 + 4 moments m, v
    assert sum(k.startswith("replicas/") for k in straight) == 4 + 1 + 8
    assert straight.keys() == resumed.keys()
    for key, value in straight.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)


# ---- 7. refusals ----
@pytest.mark.parametrize("settings, message", [
    (dict(aggregation="des_loc", optimizer="momentum"),
     r"^--aggregation=des_loc averages the moments of --optimizer=adam, which "
     r"--optimizer=momentum does not keep; use --optimizer=adam$"),
    (dict(aggregation="des_loc", optimizer="sgd"), r"--optimizer=sgd does not keep"),
    (dict(aggregation="des_loc:period=0", optimizer="adam"),
     r"des_loc option period=0 is out of range: must be >= 1$"),
    (dict(aggregation="des_loc:momentum_period=0", optimizer="adam"),
     r"des_loc option momentum_period=0 is out of range: must be >= 1$"),
    (dict(aggregation="des_loc:variance_period=-3", optimizer="adam"),
     r"des_loc option variance_period=-3 is out of range: must be >= 1$"),
    (dict(aggregation="des_loc", optimizer="adam", shard_update=True),
     r"^--shard_update with --aggregation=des_loc: the method does not split its all-reduce"),
    (dict(aggregation="des_loc", optimizer="adam", transport_dtype="bfloat16"),
     r"--transport_dtype=bfloat16 with --aggregation=des_loc: its kernel sums in the dtype"),
])
def test_refused_in_one_line(settings, message, tmp_path):
    """Refused by Config.validated(), before any device or variable exists."""
    with pytest.raises(ConfigError, match=message) as error:
        helpers.small_config(str(tmp_path / "never"), devices="cpu:2", **settings).validated()
    assert "\n" not in str(error.value)
    assert not (tmp_path / "never").exists()


def test_a_user_optimizer_that_is_not_adam_is_refused_in_one_line():
    """Given through the API (a Keras optimizer, which validation cannot name): refused when
    the step is traced, before any step runs."""
    device_set = devices.setup(devices.parse("cpu:2"))
    method = aggregation.make(SPEC, device_set, step_counter=global_step_on(device_set.host))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    replicas = Replicas(model, method, lambda: keras.optimizers.SGD(0.1))
    with pytest.raises(ConfigError, match=r"^--aggregation=des_loc averages Adam's moments: "
                                          r"the optimizer is SGD; use --optimizer=adam$"):
        method.after_update(replicas.copies)
