"""--shard_update (ZeRO stage 1): each copy updates its chunk with that chunk's state alone.

- The ring's sharded update equals its whole update bit for bit: the reduce-scatter forms
  the same mean as the all-reduce (its first half), and an element-wise optimizer makes
  the same numbers on a piece of a variable as on all of it; after 4 steps every copy's
  weights and the optimizer state (gathered whole) are the same bits. (This holds where a
  kernel rounds each product and sum once whichever path, vectorised or scalar, an entry
  takes: TensorFlow's x86 builds, made without FMA contraction. A build that fused a
  product into a sum on one path only would differ in the last bit, and fail here.)
- Every sharded method against one device within tests/tolerance.py's bound.
- A checkpoint holds the optimizer whole, with the same keys as a whole run's: saved sharded
  on 4 towers, restored sharded on 3 (chunks of other sizes) and whole on 1, and the whole
  run's own checkpoint restored sharded on 2, the state is the same bits.
- Each device holds 1/T of the state (1/groups... G/T with hierarchical), and the
  settings that cannot shard are refused in one line before anything is built.
- An optimizer's weight-decay exclusion by name holds on the pieces (new variables with
  other names), also where one chunk holds pieces of excluded and decayed variables: the
  sharded ring equals the whole ring bit for bit, as above.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from mgloop.errors import ConfigError
from mgloop.runs import checkpoint
from mgloop.step.hooks import Hook
from tests import helpers
from tests import tolerance

STEPS = 4


def state_of(trainer, folder) -> dict[str, np.ndarray]:
    """Copy 0's optimizer state whole, as a checkpoint in `folder` holds it (gathered from
    the pieces when sharded): {checkpoint key: value}."""
    path = checkpoint.Checkpointer.of_trainer(str(folder), trainer, keep=1).save(
        int(trainer.global_step.numpy()))
    reader = tf.train.load_checkpoint(path)
    return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(path)
            if name.startswith("optimizer/")}


def run(logdir, name, steps=STEPS, **settings):
    config = helpers.small_config(os.path.join(logdir, name), **settings)
    trainer, loss_sum = helpers.train_mgloop(config, helpers.batches(
        steps, config.global_batch_size))
    return trainer, loss_sum


@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_the_sharded_ring_equals_the_whole_ring_bit_for_bit(optimizer, logdir):
    common = dict(devices="cpu:4", aggregation="ring", optimizer=optimizer, learning_rate=0.05)
    whole, whole_loss = run(logdir, "whole", **common)
    sharded, sharded_loss = run(logdir, "sharded", shard_update=True, **common)
    assert sharded_loss == whole_loss
    start = helpers.copy_weights(helpers.build_trainer(helpers.small_config(
        os.path.join(logdir, "start"), **common)))[0]
    for a, b in zip(helpers.copy_weights(whole), helpers.copy_weights(sharded)):
        for x, y, x0 in zip(a, b, start):
            assert np.array_equal(x, y)
    assert any(np.abs(x - x0).max() > 1e-3 for x, x0 in zip(helpers.copy_weights(sharded)[0],
                                                            start))
    whole_state = state_of(whole, os.path.join(logdir, "whole_state"))
    sharded_state = state_of(sharded, os.path.join(logdir, "sharded_state"))
    assert sorted(whole_state) == sorted(sharded_state)  # the same keys: one layout
    for name, value in whole_state.items():
        assert value.shape == sharded_state[name].shape
        assert np.array_equal(value, sharded_state[name]), name
    slots = [v for v in sharded_state.values() if v.ndim]
    # the weights and a momentum slot each, every one moved
    assert len(slots) >= 2 * len(start) and all(np.abs(v).max() > 0 for v in slots)


@pytest.mark.parametrize("spec", ["ring", "collective", "hierarchical:groups=2"])
def test_each_sharded_method_equals_one_device(spec, logdir):
    config = helpers.small_config(logdir, devices="cpu:4", aggregation=spec, shard_update=True)
    trainer, loss_sum = helpers.train_mgloop(config, helpers.batches(5))
    reference = helpers.small_config(logdir, devices="cpu:4", aggregation=spec)
    expected = helpers.train_reference_bounded(reference, helpers.batches(5))
    copies = helpers.copy_weights(trainer)
    for weights in copies:
        tolerance.assert_matches_reference(weights, loss_sum, expected)
        # every copy took the same gathered chunks: the replicas stay bit-identical
        assert all(np.array_equal(a, b) for a, b in zip(weights, copies[0]))


def test_a_checkpoint_resumes_with_other_towers_and_without_sharding(logdir):
    batch = dict(global_batch_size=24, optimizer="adam")  # 4, 3 and 1 towers
    saved, _ = run(logdir, "saved", devices="cpu:4", aggregation="ring", shard_update=True,
                   **batch)
    folder = os.path.join(logdir, "checkpoints")
    expected_state = state_of(saved, folder)
    expected_weights = helpers.copy_weights(saved)[0]
    for name, settings in [("three", dict(devices="cpu:3", aggregation="ring",
                                          shard_update=True)),
                           ("one", dict(devices="cpu:1", aggregation="ps_cpu"))]:
        config = helpers.small_config(os.path.join(logdir, name), **batch, **settings)
        trainer = helpers.build_trainer(config)
        restored = checkpoint.Checkpointer.of_trainer(folder, trainer, keep=1)
        assert restored.restore_latest(tidy=False) is not None
        trainer.sync_replicas()
        state = state_of(trainer, os.path.join(logdir, f"{name}_state"))
        assert sorted(state) == sorted(expected_state)
        assert all(np.array_equal(state[key], expected_state[key]) for key in state)
        for weights in helpers.copy_weights(trainer):
            assert all(np.array_equal(x, y) for x, y in zip(weights, expected_weights))
        if name == "three":  # and the pieces took the restored weights: a step agrees
            whole = helpers.build_trainer(helpers.small_config(
                os.path.join(logdir, "three_whole"), devices="cpu:3", aggregation="ring",
                **batch))
            checkpoint.Checkpointer.of_trainer(folder, whole, keep=1).restore_latest(
                tidy=False)
            whole.sync_replicas()
            steps = helpers.batches(STEPS + 1, 24)[STEPS:]
            helpers.run_batches(trainer, steps)
            helpers.run_batches(whole, steps)
            assert all(np.array_equal(x, y) for x, y in zip(
                helpers.copy_weights(trainer)[2], helpers.copy_weights(whole)[2]))
    # and the reverse: the whole run's own checkpoint (Keras's optimizer) into the pieces
    folder = os.path.join(logdir, "from_whole")
    state_of(trainer, folder)
    sharded = helpers.build_trainer(helpers.small_config(
        os.path.join(logdir, "two"), devices="cpu:2", aggregation="collective",
        shard_update=True, **batch))
    assert checkpoint.Checkpointer.of_trainer(folder, sharded, keep=1).restore_latest(
        tidy=False) is not None
    sharded.sync_replicas()
    state = state_of(sharded, os.path.join(logdir, "two_state"))
    assert sorted(state) == sorted(expected_state)
    assert all(np.array_equal(state[key], expected_state[key]) for key in state)


@pytest.mark.parametrize("spec,share", [("ring", 4), ("collective", 4),
                                        ("hierarchical:groups=2", 2)])
def test_each_device_holds_its_share_of_the_state(spec, share, logdir):
    whole = helpers.build_trainer(helpers.small_config(
        os.path.join(logdir, "whole"), devices="cpu:4", aggregation=spec, optimizer="adam"))
    sharded = helpers.build_trainer(helpers.small_config(
        os.path.join(logdir, "sharded"), devices="cpu:4", aggregation=spec, optimizer="adam",
        shard_update=True))
    before, after = whole.replicas.optimizer_bytes(), sharded.replicas.optimizer_bytes()
    scalars = 2 * 8  # the iteration count and the learning rate, on every copy
    for device, total in before["state"].items():
        assert after["state"][device] <= (total - scalars) / share + scalars + 16
        weights = sum(v.numpy().nbytes for v in sharded.copies[0].trainable)
        assert after["owned_weights"][device] <= weights / share + 16
    assert before["owned_weights"] == {}


@pytest.mark.parametrize("settings,expected", [
    (dict(aggregation="ps_cpu"), "does not split its all-reduce"),
    (dict(aggregation="ring:shards=2"), "ring:shards=1"),
    (dict(aggregation="ring", nodes=2), "--nodes=2"),
    (dict(aggregation="collective", devices="cpu:11"), "at most 10 towers"),
    (dict(aggregation="ring", towers_per_device=2), "--towers_per_device=2"),
    (dict(aggregation="ring", mixed_precision="mixed_float16"), "mixed_float16"),
    (dict(aggregation="ring", histogram_every=5), "--histogram_every=5"),
])
def test_settings_that_cannot_shard_are_refused_in_one_line(settings, expected, logdir):
    config = helpers.small_config(logdir, **{"devices": "cpu:4", **settings},
                                  shard_update=True)
    with pytest.raises(ConfigError, match="--shard_update") as error:
        config.validated(on_disk=False)
    assert expected in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("optimizer,expected", [
    (lambda: keras.optimizers.Lamb(0.01), "Lamb is not"),
    (lambda: keras.optimizers.Adam(0.01, global_clipnorm=1.0), "global_clipnorm"),
    (lambda: keras.optimizers.SGD(0.01, clipnorm=1.0), "clipnorm"),
])
def test_optimizers_that_are_not_element_wise_are_refused_before_any_copy(
        optimizer, expected, logdir, monkeypatch):
    assert refused_before_any_copy(logdir, monkeypatch, expected, optimizer=optimizer)


def excluding_biases():
    optimizer = keras.optimizers.AdamW(0.05, weight_decay=0.5)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


def trainer_with(logdir, name, optimizer, **settings):
    from mgloop.cluster import devices
    from mgloop.runs import experiment
    config = helpers.small_config(os.path.join(logdir, name), **settings).validated()
    return experiment.build_trainer(
        config, devices.setup(devices.parse(config.devices)), helpers.model_fn("mlp"),
        experiment.default_loss(), helpers.DATASET.input_shape, optimizer=optimizer)


def test_a_weight_decay_excluded_by_name_holds_on_the_pieces_bit_for_bit(logdir):
    """AdamW(weight_decay=0.5) excluding "bias": the biases are not decayed, the kernels
    are, on the pieces as on the whole variables. Default packing puts every variable in
    one segment, so a copy's chunk holds pieces of kernels and biases together."""
    common = dict(devices="cpu:2", aggregation="ring")  # (a + b) / 2: one order of sum
    trainers, losses = {}, {}
    for shard in (False, True):
        trainers[shard] = trainer_with(logdir, f"shard_{shard}", excluding_biases,
                                       shard_update=shard, **common)
        losses[shard] = helpers.run_batches(trainers[shard], helpers.batches(STEPS))
    update = trainers[True].replicas.update
    names = [v.name for v in trainers[True].copies[0].trainable]
    mixed = [{"bias" in names[p.variable] for p in update.layout.pieces_of(c)}
             for c in range(2)]
    assert {True, False} in mixed  # a chunk with excluded and decayed pieces
    assert losses[True] == losses[False]
    for a, b in zip(helpers.copy_weights(trainers[False]),
                    helpers.copy_weights(trainers[True])):
        for name, x, y in zip(names, a, b):
            assert np.array_equal(x, y), name


def test_an_optimizer_with_a_method_replaced_on_the_instance_is_refused_before_any_copy(
        logdir, monkeypatch):
    def decays_kernels_only():  # keyed on a name no piece has
        optimizer = keras.optimizers.AdamW(0.05, weight_decay=0.5)
        optimizer._use_weight_decay = lambda variable: "kernel" in variable.name
        return optimizer
    assert refused_before_any_copy(logdir, monkeypatch,
                                   r"_use_weight_decay \(replaced on the instance\)",
                                   optimizer=decays_kernels_only)


class ReadsTheMean(Hook):
    def after_exchange(self, grads):
        return []


def test_a_hook_reading_the_exchanged_gradients_is_refused_before_any_copy(logdir,
                                                                          monkeypatch):
    assert refused_before_any_copy(logdir, monkeypatch, "the hook ReadsTheMean",
                                   hooks=[ReadsTheMean()],
                                   optimizer=lambda: keras.optimizers.SGD(0.1))


def refused_before_any_copy(logdir, monkeypatch, expected, **given) -> bool:
    """Whether assemble.build refuses a sharded ring with `given` (one line matching
    `expected`) before it makes the replicas."""
    from mgloop import aggregation
    from mgloop.cluster import devices
    from mgloop.runs import assemble
    from mgloop.step import replicas as replicas_lib
    built = []
    monkeypatch.setattr(replicas_lib.Replicas, "__init__", lambda *a, **k: built.append(1))
    config = helpers.small_config(logdir, devices="cpu:2", aggregation="ring",
                                  shard_update=True).validated(on_disk=False)
    method = aggregation.make(config.aggregation, devices.setup(devices.parse(config.devices)))
    with pytest.raises(ConfigError, match=expected) as error:
        assemble.build(helpers.model_fn("mlp"), None, method, lambda: None,
                       helpers.DATASET.input_shape, config, **given)
    return "\n" not in str(error.value) and built == []


@pytest.mark.parametrize("spec,towers,holders", [("ring", 3, 1), ("collective", 3, 1),
                                                 ("collective", 4, 1),
                                                 ("hierarchical:groups=2", 4, 2)])
@pytest.mark.parametrize("bucket_bytes", [0, 64])
def test_the_pieces_cover_every_entry_as_a_numpy_model_of_the_chunks(spec, towers, holders,
                                                                     bucket_bytes):
    """Segments packed up to `bucket_bytes` (0: each variable alone) of shapes that do not
    divide into the chunks; the numpy model: each segment's flat entries cut at the
    method's chunk bounds, chunk k held by the copies whose owned_shard is k. The pieces of
    every copy cover each entry of every variable `holders` times (hierarchical: once per
    group), each piece at its place in its copy's chunk."""
    from mgloop import aggregation
    from mgloop.cluster import devices
    from mgloop.step.sharded_update import Layout
    method = aggregation.make(spec, devices.setup(devices.parse(f"cpu:{towers}")))
    shapes = [(5, 3), (7,), (1,), (2, 2), (11,)]
    variables = [tf.Variable(tf.zeros(shape)) for shape in shapes]
    layout = Layout(variables, method, towers, bucket_bytes)
    assert sorted(i for segment in layout.segments for i in segment) == list(range(5))
    covered = [np.zeros(int(np.prod(shape)), int) for shape in shapes]
    for c in range(towers):
        for segment, pieces in zip(layout.segments, layout.pieces[c]):
            starts = np.cumsum([0] + [int(np.prod(shapes[i])) for i in segment])
            first, last = method.shard_bounds(int(starts[-1]))[method.owned_shard(c)]
            assert sum(p.end - p.start for p in pieces) == last - first
            for p in pieces:
                position = starts[segment.index(p.variable)] + p.start
                assert p.offset == position - first  # where the piece sits in the chunk
                covered[p.variable][p.start:p.end] += 1
    assert all((entries == holders).all() for entries in covered)
