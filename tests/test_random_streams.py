"""Random layers on towers: each tower draws its own dropout mask (mgloop/step/random_streams.py).

The model is Dropout(0.5) then a Dense layer whose kernel is the identity, fed
all-ones inputs, and trained with a zero loss (so the kernel stays the identity):
its output is exactly mask / (1 - rate), and the loss records it per call.

Statistical bounds (rate r = 1/2, every element kept independently with
probability 1/2 when the streams are right): over n elements the kept count
(and the count of positions where two independent masks agree) is
Binomial(n, 1/2), standard deviation sqrt(n)/2; the tests allow 5 standard
deviations (probability about 6e-7 of failing for a correct implementation; the
draws are fixed by the seed, so a pass does not flicker). Identical masks agree
on all n positions, 2 sqrt(n) standard deviations from n/2 (16 for n = 256).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from mgloop import aggregation
from mgloop.cluster import workers as cluster, devices
from mgloop.runs import assemble, experiment
from tests import helpers

RATE, FEATURES, TOWERS = 0.5, 64, 4
SIGMAS = 5


def dropout_model():
    inputs = keras.Input((FEATURES,))
    dropped = keras.layers.Dropout(RATE)(inputs)
    outputs = keras.layers.Dense(FEATURES, use_bias=False, kernel_initializer="identity")(dropped)
    return keras.Model(inputs, outputs)


class OutputRecorder:
    """A zero loss that keeps the last model outputs each tower gave it: tower t's (on
    device t, one tower per device) in its variable t (colocate's one loss: in its one).
    It writes a variable of its own, so the step traces the towers' passes one by one
    (per_tower.SharedPass); a trace outside any tower's device writes variable 0."""

    def __init__(self, calls: int, rows: int):
        with tf.device("/device:CPU:0"):
            self.seen = [tf.Variable(tf.zeros([rows, FEATURES]), trainable=False)
                         for _ in range(calls)]

    def __call__(self, y, outputs):
        device = tf.DeviceSpec.from_string(outputs.device or "/device:CPU:0")
        self.seen[device.device_index % len(self.seen)].assign(outputs)
        return 0.0 * tf.reduce_mean(outputs, axis=-1)

    def kept(self) -> np.ndarray:
        """The global batch's mask of the last step: [B, FEATURES] booleans."""
        return np.concatenate([v.numpy() for v in self.seen]) != 0


def within_binomial(count: int, n: int) -> bool:
    """|count - n/2| <= SIGMAS standard deviations of Binomial(n, 1/2)."""
    return abs(count - n / 2) <= SIGMAS * np.sqrt(n) / 2


def train_masks(tmp_path, aggregation: str, steps: int = 2):
    """Per step, the global batch's dropout mask on TOWERS towers; and the trainer."""
    config = helpers.small_config(str(tmp_path / aggregation), devices=f"cpu:{TOWERS}",
                                  aggregation=aggregation)
    calls = 1 if aggregation == "colocate" else TOWERS  # colocate: one loss, on the host
    recorder = OutputRecorder(calls, helpers.GLOBAL_BATCH // calls)
    trainer = helpers.build_trainer(config, dropout_model, recorder, input_shape=(FEATURES,))
    x = np.ones((helpers.GLOBAL_BATCH, FEATURES), np.float32)
    y = np.zeros(helpers.GLOBAL_BATCH, np.int32)
    masks = []
    for _ in range(steps):
        helpers.run_batches(trainer, [(x, y)])
        masks.append(recorder.kept())
    outputs = np.concatenate([v.numpy() for v in recorder.seen])
    np.testing.assert_array_equal(outputs[masks[-1]], 1 / (1 - RATE))  # mask / (1 - rate)
    return masks, trainer


@pytest.fixture(scope="module")
def ring_run(tmp_path_factory):
    return train_masks(tmp_path_factory.mktemp("ring"), "ring")


def assert_independent_tower_masks(masks):
    for mask in masks:
        n = mask.size
        assert within_binomial(int(mask.sum()), n), mask.mean()  # kept fraction ~ 1 - rate
        blocks = np.split(mask, TOWERS)  # tower t's rows [t B/T, (t+1) B/T)
        for t in range(TOWERS):
            for u in range(t + 1, TOWERS):
                agree = int((blocks[t] == blocks[u]).sum())
                assert within_binomial(agree, blocks[t].size), (t, u, agree)
    agree = int((masks[0] == masks[1]).sum())  # a new mask every step
    assert within_binomial(agree, masks[0].size), agree


@pytest.mark.parametrize("aggregation", ["ps_cpu", "colocate"])
def test_towers_draw_independent_masks(aggregation, tmp_path):
    masks, _ = train_masks(tmp_path, aggregation)
    assert_independent_tower_masks(masks)


def test_replicas_draw_independent_masks_and_advance_the_seed_as_one_device(ring_run):
    masks, trainer = ring_run
    assert_independent_tower_masks(masks)
    assert trainer.step.group_pass._per_tower  # the recorder's variables: one trace a tower
    position = trainer.random_streams.indices[0]
    first = trainer.model.layers[1].seed_generator.state.numpy()
    assert first[1] == 2  # one draw per step, as one device's generator after 2 steps
    for copy in trainer.copies:  # every copy holds the one device's state
        np.testing.assert_array_equal(copy.non_trainable[position].numpy(), first)
    x = np.ones((6, FEATURES), np.float32)
    np.testing.assert_array_equal(trainer.predict(x, batch_size=6), x)  # no dropout at inference


def test_same_seed_draws_the_same_masks(ring_run, tmp_path):
    again, _ = train_masks(tmp_path, "ring")
    for first, second in zip(ring_run[0], again):
        np.testing.assert_array_equal(first, second)
    assert not np.array_equal(*np.split(again[0], TOWERS)[:2])  # and not one mask for all


def test_tower_streams_follow_the_global_tower_index():
    """Worker w's tower t draws as global tower w*T + t: no two towers of a job share a key."""
    from mgloop.step import random_streams  # a module of its own (absent before the fix)
    model = dropout_model()
    state = [v.value for v in model.non_trainable_variables]
    index = random_streams.seed_state_indices(model)
    assert index == [0]
    workers = [random_streams.RandomStreams(model, first_tower=w * TOWERS) for w in range(2)]
    keys = [int(streams.for_tower(state, t, "/device:CPU:0")[0][0])
            for streams in workers for t in range(TOWERS)]
    assert keys[0] == int(state[0][0])  # global tower 0 draws the one device's stream:
    layer = model.layers[1]  # its rows are the first rows of one device's draw (Philox)
    one_device, _ = layer.stateless_call([], state, tf.ones([16, FEATURES]), training=True)
    tower_0, _ = layer.stateless_call([], workers[0].for_tower(state, 0, "/device:CPU:0"),
                                      tf.ones([4, FEATURES]), training=True)
    np.testing.assert_array_equal(tower_0, one_device[:4])
    assert len(set(keys)) == len(keys)
    np.testing.assert_array_equal(workers[1].for_tower(state, 1, "/device:CPU:0")[0],
                                  workers[0].for_tower(state, TOWERS + 1, "/device:CPU:0")[0])
    given = workers[1].for_tower(state, 2, "/device:CPU:0")
    returned = [tf.stack([given[0][0], given[0][1] + 3])]  # a pass of 3 draws
    np.testing.assert_array_equal(workers[1].after_tower(state, returned)[0],
                                  state[0].numpy() + [0, 3])


def test_trainer_numbers_its_towers_globally():
    """Worker 1 of 2 with 2 towers: its towers are global towers 2 and 3 (the Trainer's
    wiring of the streams tested above)."""
    device_set = devices.setup(devices.parse("cpu:2"))
    method = aggregation.get("ring")(device_set)
    method.cluster = cluster.Cluster(workers=("a:1", "b:2"), index=1)  # as CrossWorker has
    trainer = assemble.build(dropout_model, experiment.default_loss(), method,
                             lambda: keras.optimizers.SGD(0.1))
    assert trainer.random_streams.first_tower == 2
    assert trainer.random_streams.indices == [0]
