"""The aggregation contract, checked for every registered method (`aggregation.names()`).

Including `topk_ef`, which tests/plugins/topk_ef.py registers through the plugin
route (`aggregation.load_plugins`, what `--plugin` does). For each method, on the
small MLP of tests/helpers.py (one hidden layer: the smallest that shows every clause,
2-D kernels and 1-D biases of two sizes, a gradient through a nonlinearity), 5 steps under
--deterministic:

- an exact method (`exact`) equals one device on 2 and 4 towers, within the bound
  of tests/tolerance.py computed along one shared reference run;
- a lossy method declares `error_bound` rho (per variable: `error_bound_for`), and
  every exchange of a fresh instance (its state built, then carried over 6 calls of
  stand-in gradients of varied scale) lies within rho * G of the exact mean (G: the largest
  tower gradient norm sent so far, per variable), on 2 and 4 towers; its training run, on
  the tower count of its other tests (`towers_for`: 2, or 4 where it refuses 2), moves the
  weights and stays finite (the bound needs a trainer's devices and variables, not a run);
- a method without an exchange (`independent`) trains copy t exactly as one device
  trains on shard t alone;
- a method whose updates are by design not the synchronous one (stale reads, local
  steps) declares `identity` options, with which it equals one device as an exact one;
  one with no such options (`SAME_AS`: des_loc, local Adam) equals, with its degenerate
  options, another method bit for bit on 2 towers (des_loc's every period 1 is localsgd
  averaging its slots);
- its state (`state_variables`, made by `build`) survives a checkpoint and a restore
  into a second trainer, whose next step is then bit-identical to the first's (every
  copy's, when the method's copies differ between syncs: `copies_differ`);
- exchange timing (`Trainer.time_exchange`) leaves its state, and every variable, as
  training left them;
- `reduce` never receives a non-trainable variable (a model with batch norm; what the
  traced step hands it).
A method whose devices are not here (nccl: GPUs) is checked to refuse in one line, and so
is a tower count a method's `check` cannot serve (krum with 2 towers): it must then run
on 4. A lossy method whose `error_bound` is None at a tower count (median on 2 towers is
their mean) is held there to the exact methods' standard.
"""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from mgloop import aggregation
from mgloop.cluster import devices
from mgloop.runs import checkpoint
from mgloop.errors import ConfigError
from tests import helpers, tolerance

PLUGINS = ("tests.plugins.topk_ef",)
aggregation.load_plugins(PLUGINS)  # the plugin route: as --plugin=tests.plugins.topk_ef
METHODS = aggregation.names()
# Each method's tests share its trained runs (the `trained` cache): under pytest-xdist
# (--dist loadgroup, setup.cfg) they run in one process, so each run is built once.
BY_METHOD = [pytest.param(name, marks=pytest.mark.xdist_group(f"contract_{name}"))
             for name in METHODS]
STEPS = 5
SPECS = {"topk_ef": "topk_ef:ratio=0.5",  # an option set, as a user would
         "trimmed_mean": "trimmed_mean:trim=1", "krum": "krum:f=0",
         "multikrum": "multikrum:f=0,m=2", "bulyan": "bulyan:f=0",
         "threshold": "threshold:value=0.5",  # drops enough of the stand-ins to be lossy
         # outer steps of both fragments within the 5 steps, and one in the step after the
         # restore, with quantised outer gradients
         "streaming_diloco": "streaming_diloco:period=4,fragments=2,outer_bits=4",
         # Q itself, whose bound is finite (sign(Q)'s is inf: it has norm sqrt(n))
         "demo": "demo:sign=false,decay=0.9",
         # outer steps after steps 2 and 5 (the step after the restore)
         "sparta_diloco": "sparta_diloco:fraction=0.1,period=3",
         # outer steps after steps 2 and 5 (the step after the restore), 2-bit payloads
         "sparseloco": "sparseloco:period=3,density=0.1",
         # x, m, v synced after steps (1, 3), (2), (4) and x, m in the step after the restore
         "des_loc": "des_loc:period=2,momentum_period=3,variance_period=5"}
# Methods with no identity with one device whose degenerate options are another method's,
# bit for bit on 2 towers (each ring sum one addition, whatever the vector it is cut from):
# every period of des_loc 1 is localsgd averaging Adam's slots too (tests/test_des_loc.py).
SAME_AS = {"des_loc": ("des_loc:period=1,momentum_period=1,variance_period=1",
                       "localsgd:period=1,slots=average")}


@dataclasses.dataclass
class Run:
    config: object
    trainer: object
    start: list  # copy 0's weights before training
    loss_sum: float


def config_for(directory, name, towers, **overrides):
    settings = dict(aggregation=SPECS.get(name, name), plugins=PLUGINS)
    settings.update(overrides)
    method, options = aggregation.parse(settings["aggregation"])
    if method.applies_momentum(options):  # momentum inside the method: plain SGD outside
        settings.setdefault("optimizer", "sgd")
    needed = method.capabilities.needs_optimizer
    if needed:  # des_loc: Adam, at the eps of the bound's premise (tolerance.py)
        settings.setdefault("optimizer", needed)
        settings.setdefault("adam_epsilon", 1e-3)
    return helpers.small_config(str(directory), devices=f"cpu:{towers}", **settings)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    cache = {}

    def get(name, towers, identity=False, steps=STEPS):
        """The run of `steps` steps (0: the trainer built, not trained)."""
        if (name, towers, identity, steps) not in cache:
            overrides = dict(aggregation=f"{name}:{aggregation.get(name).capabilities.identity}") \
                if identity else {}
            config = config_for(tmp_path_factory.mktemp("run"), name, towers, **overrides)
            trainer = helpers.build_trainer(config)
            start = helpers.copy_weights(trainer)[0]
            loss_sum = helpers.run_batches(trainer, helpers.batches(steps)) if steps else None
            cache[name, towers, identity, steps] = Run(config, trainer, start, loss_sum)
        return cache[name, towers, identity, steps]
    return get


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(weights, loss sum, StepBound) of one device on the given batches, cached."""
    cache = {}

    def get(key, batches):
        if key not in cache:
            config = helpers.small_config(str(tmp_path_factory.mktemp("reference")))
            cache[key] = helpers.train_reference_bounded(config, batches)
        return cache[key]
    return get


def refused_here(name, tmp_path, towers) -> bool:
    """True (after checking the refusal is one line naming the method) when the method's
    `device_kinds` exclude the CPU towers of this machine, or its `check` refuses `towers`
    (then it must run on 4); False when it runs here."""
    method = aggregation.get(name)
    if "cpu" in method.capabilities.device_kinds and serves(name, towers):
        return False
    with pytest.raises(ConfigError) as error:
        config_for(tmp_path, name, towers).validated()
    assert "\n" not in str(error.value) and f"--aggregation={name}" in str(error.value)
    assert "cpu" not in method.capabilities.device_kinds or serves(name, 4)
    return True


def serves(name, towers) -> bool:
    """Whether the method's `check` (with SPECS's options) accepts `towers` CPU towers."""
    method, options = aggregation.parse(SPECS.get(name, name))
    try:
        method.check(devices.DeviceRequest("cpu", tuple(range(towers))), options)
    except ConfigError:
        return False
    return True


def towers_for(name) -> int:
    """2 towers, or 4 where the method refuses 2."""
    return 2 if serves(name, 2) else 4


def exact_at(name, towers) -> bool:
    """`exact`, or a lossy method whose error_bound is None at this tower count."""
    method, options = aggregation.parse(SPECS.get(name, name))
    caps = method.capabilities
    return caps.exact or (caps.exchanges and method.error_bound(options, towers) is None)


def shard(batches, tower, towers):
    size = helpers.GLOBAL_BATCH // towers
    return [(x[tower * size:(tower + 1) * size], y[tower * size:(tower + 1) * size])
            for x, y in batches]


@pytest.mark.parametrize("towers", [2, 4])
@pytest.mark.parametrize("name", BY_METHOD)
def test_aggregate_is_what_the_method_declares(name, towers, trained, reference, tmp_path):
    if refused_here(name, tmp_path, towers):
        return
    method = aggregation.get(name)
    if name in SAME_AS:
        assert_same_as(name, towers, tmp_path)
        return
    identity = method.capabilities.identity is not None  # its identity options: as exact
    exact = exact_at(name, towers) or identity
    if not exact and method.capabilities.exchanges and towers != towers_for(name):
        assert_within_declared_bound(trained(name, towers, steps=0), towers)  # trained on 2
        return
    run = trained(name, towers, identity)
    copies = helpers.copy_weights(run.trainer)
    if exact or not method.capabilities.exchanges:  # it trained
        assert any(np.abs(w - w0).max() > 1e-3 for w, w0 in zip(copies[-1], run.start))
    if exact:
        expected = reference("global", helpers.batches(STEPS))
        for weights in copies:
            tolerance.assert_matches_reference(weights, run.loss_sum, expected)
    elif method.capabilities.exchanges:
        assert all(np.isfinite(w).all() for weights in copies for w in weights)
        assert_within_declared_bound(run, towers)
    else:  # no exchange: copy t is one device trained on shard t alone
        assert len(copies) == towers
        for t, weights in enumerate(copies):
            batches = shard(helpers.batches(STEPS), t, towers)
            tolerance.assert_matches_reference(weights, None, reference((towers, t), batches))


def assert_same_as(name, towers, tmp_path):
    """SAME_AS's pair trained side by side: equal bit for bit on 2 towers; on 4 (the ring
    sums its chunks in an order that depends on the vector) both train and stay finite."""
    runs, own = [], config_for(tmp_path, name, towers)  # the named method's optimizer
    for spec in SAME_AS[name]:
        config = dataclasses.replace(own, aggregation=spec,
                                     logdir=str(tmp_path / spec.split(":")[0]))
        trainer = helpers.build_trainer(config)
        start = helpers.copy_weights(trainer)[0]
        helpers.run_batches(trainer, helpers.batches(STEPS))
        copies = helpers.copy_weights(trainer)
        assert any(np.abs(w - w0).max() > 1e-3 for w, w0 in zip(copies[-1], start))
        assert all(np.isfinite(w).all() for weights in copies for w in weights)
        runs.append(copies)
    if towers == 2:
        for a, b in zip(*runs):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)


def assert_within_declared_bound(run, towers):
    """Every exchange of a fresh instance within rho * G_v of the exact mean (see top)."""
    method, options = aggregation.parse(run.config.aggregation)
    rhos = [method.error_bound_for(options, towers, v.shape.num_elements())
            for v in run.trainer.copies[0].trainable]
    assert all(rho is not None and rho > 0 for rho in rhos), (
        f"lossy {method.name} declares no error_bound")
    fresh = aggregation.make(run.config.aggregation, run.trainer.aggregation.devices)
    variables = run.trainer.copies[0].trainable
    fresh.build(variables)
    rng = np.random.default_rng(0)
    largest = np.zeros(len(variables))
    worst = 0.0
    for scale in (1.0, 0.1, 3.0, 0.01, 1.0, 0.3):
        values = [[rng.standard_normal(tuple(v.shape)).astype(np.float32) * scale
                   for v in variables] for _ in range(towers)]
        placed = []
        for device, per_tower in zip(fresh.devices.towers, values):
            with tf.device(device):
                placed.append([tf.constant(g) for g in per_tower])
        out = fresh.reduce(placed, variables, average=True)
        largest = np.maximum(largest, [max(np.linalg.norm(values[t][i]) for t in range(towers))
                                       for i in range(len(variables))])
        for per_copy in out:
            for i, value in enumerate(per_copy):
                exact = np.mean([values[t][i] for t in range(towers)], axis=0, dtype=np.float64)
                error = np.linalg.norm(value.numpy() - exact)
                assert error <= rhos[i] * largest[i], (
                    f"{method.name}: variable {i} off by {error:.3g} > {rhos[i]:.3g} * "
                    f"{largest[i]:.3g}")
                worst = max(worst, error / largest[i])
    assert worst > 1e-3  # lossy indeed: the stand-ins were compressed


def all_values(trainer, copies=None):
    """Every variable of `copies` (default all) with their optimizers, the method's state,
    the step, as numpy arrays."""
    copies = trainer.copies if copies is None else copies
    variables = [v for copy in copies for v in copy.variables]
    variables += [v for copy in copies for v in copy.optimizer.variables]
    variables += list(trainer.aggregation.state_variables) + [trainer.global_step]
    return [np.array(v.numpy()) for v in variables]


@pytest.mark.parametrize("name", BY_METHOD)
def test_state_survives_checkpoint_and_resume(name, trained, tmp_path):
    if refused_here(name, tmp_path, towers_for(name)):
        return
    run = trained(name, towers_for(name))
    state = run.trainer.aggregation.state_variables
    weights = {id(v) for copy in run.trainer.copies for v in copy.variables}
    assert all(isinstance(v, tf.Variable) and not v.trainable and id(v) not in weights
               for v in state)
    folder = str(tmp_path / "checkpoints")
    saver = checkpoint.Checkpointer.of_trainer(folder, run.trainer, keep=1)
    path = saver.save(int(run.trainer.global_step.numpy()))
    saved = [n for n, _ in tf.train.list_variables(path) if n.startswith("aggregation_state/")]
    assert len(saved) == len(state)
    resumed = helpers.build_trainer(dataclasses.replace(run.config, logdir=str(tmp_path)))
    restorer = checkpoint.Checkpointer.of_trainer(folder, resumed, keep=1)
    assert restorer.restore_latest() == path
    assert restorer.restored_every_copy == aggregation.get(name).capabilities.copies_differ
    if not restorer.restored_every_copy:
        resumed.sync_replicas()
    for restored, original in zip(resumed.aggregation.state_variables, state):
        np.testing.assert_array_equal(restored.numpy(), original.numpy())
    batch = helpers.batches(STEPS + 1)[STEPS:]  # the next step, on both: bit-identical
    helpers.run_batches(run.trainer, batch)
    helpers.run_batches(resumed, batch)
    # copy 0 is what a checkpoint holds (independent's other replicas restart from it),
    # every copy when they differ between syncs
    held = len(run.trainer.copies) if aggregation.get(name).capabilities.copies_differ else 1
    for a, b in zip(all_values(resumed, resumed.copies[:held]),
                    all_values(run.trainer, run.trainer.copies[:held])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", BY_METHOD)
def test_exchange_timing_leaves_the_state(name, trained, tmp_path):
    if refused_here(name, tmp_path, towers_for(name)):
        return
    run = trained(name, towers_for(name))
    before = all_values(run.trainer)
    seconds = run.trainer.time_exchange(repeats=1, per_call=2)
    assert (seconds is None) == aggregation.get(name).capabilities.single_loss
    for after, value in zip(all_values(run.trainer), before):
        np.testing.assert_array_equal(after, value)


def batch_norm_model():
    """Trainable gamma, beta, kernel and bias beside the moving statistics."""
    return keras.Sequential([
        keras.Input(helpers.DATASET.input_shape), keras.layers.Flatten(),
        keras.layers.BatchNormalization(), keras.layers.Dense(10)])


@pytest.mark.parametrize("name", BY_METHOD)
def test_reduce_never_receives_a_non_trainable_variable(name, tmp_path):
    if refused_here(name, tmp_path, towers_for(name)):
        return
    trainer = helpers.build_trainer(config_for(tmp_path, name, towers_for(name)),
                                    batch_norm_model)
    method = trainer.aggregation
    handed = []
    reduce = method.reduce

    def spy(tower_values, variables, average=True):
        handed.append((list(variables), [list(values) for values in tower_values]))
        return reduce(tower_values, variables, average)

    method.reduce = spy
    helpers.trace_batches(trainer, helpers.batches(1))  # what the step hands: its trace
    trainable = trainer.copies[0].trainable
    assert trainer.copies[0].non_trainable  # the moving statistics exist
    assert bool(handed) != method.capabilities.single_loss  # a per-tower method reduced
    handed_elements = [0] * len(handed[0][1]) if handed else []
    for variables, tower_values in handed:
        assert all(any(v is w for w in trainable) for v in variables)
        for t, values in enumerate(tower_values):
            if method.capabilities.summable:  # packed buckets: 1-D, several variables' each
                handed_elements[t] += sum(g.shape.num_elements() for g in values)
            else:  # one gradient per variable, in its shape
                assert [tuple(g.shape) for g in values] == [tuple(v.shape) for v in variables]
    if handed and method.capabilities.summable:  # every trainable gradient once, nothing else
        assert handed_elements == [sum(v.shape.num_elements() for v in trainable)] * len(
            handed_elements)
