"""A user's data (data.as_input): tf.data with dict features, short batches (dropped, or
padded and weighted: the mean over the real examples), refusals, TFRecord files with resume."""

import dataclasses
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import mgloop
from mgloop import data
from mgloop.cluster import devices
from mgloop.runs import experiment, run_inputs
from mgloop.data import padding, user_input
from mgloop.errors import ConfigError
from tests import helpers, tolerance
from tests.plugins import tfrecord_data

N, FEATURES, CLASSES, BATCH, STEPS = 21, 4, 3, 8, 4  # a pass: 8 + 8 + a short batch of 5
RNG = np.random.default_rng(5)
X = RNG.standard_normal((N, FEATURES)).astype(np.float32)
Y = RNG.integers(CLASSES, size=N).astype(np.int32)
# the reference's global batches: a pass in order, its last 5 examples dropped or trained
EXPECTED = {True: [slice(0, 8), slice(8, 16), slice(0, 8), slice(8, 16)],
            False: [slice(0, 8), slice(8, 16), slice(16, 21), slice(0, 8)]}


def dict_examples():
    return tf.data.Dataset.from_tensor_slices(({"a": X[:, :2], "b": X[:, 2:]}, Y))


def dict_model():
    keras.utils.set_random_seed(11)
    a, b = keras.Input((2,), name="a"), keras.Input((2,), name="b")
    out = keras.layers.Dense(CLASSES)(keras.layers.Concatenate()([a, b]))
    return keras.Model({"a": a, "b": b}, out)


def as_input(given, config, workers=None, what="train_data"):
    """`given` as the run of validated `config` reads it (on `workers`)."""
    return data.as_input(given, config.data, run_inputs.reading(config, workers), what)


def config_for(logdir, drop_remainder):
    return helpers.small_config(logdir, devices="cpu:2", aggregation="ring",
                                global_batch_size=BATCH, drop_remainder=drop_remainder,
                                train_steps=STEPS, steps_per_loop=STEPS).validated()


def reference(config, template, slices):
    """One device, one tape, on the real examples of each step: the concatenated features are
    the same Dense as the dict model's (its kernel copied). Returns (weights, loss sum, bound)."""
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(CLASSES)])
    model.set_weights(template.get_weights())
    optimizer = keras.optimizers.SGD(config.learning_rate, momentum=0.9)
    loss_fn, bound, loss_sum = experiment.default_loss(), tolerance.StepBound(), 0.0
    for part in slices:
        x, y = tf.constant(X[part]), tf.constant(Y[part])
        bound.before(model, optimizer, loss_fn, x, y)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(y, model(x)))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))
        bound.after()
        loss_sum += float(loss)
    return [v.numpy() for v in model.trainable_variables], loss_sum, bound


@pytest.fixture(scope="module", params=[True, False], ids=["drop", "pad"])
def trained(request, tmp_path_factory):
    config = config_for(str(tmp_path_factory.mktemp("run")), request.param)
    device_set = devices.setup(devices.parse(config.devices, config.towers_per_device))
    source = as_input(dict_examples(), config)
    trainer = experiment.build_trainer(config, device_set, dict_model,
                                       experiment.default_loss(), source.input_shape)
    source.check_model(trainer.model)
    initial = dict_model()
    result = trainer.train_loop(iter(source.train_batches(0)), STEPS)
    return request.param, trainer, result, reference(config, initial,
                                                     EXPECTED[request.param])


def test_dict_features_and_short_batches_equal_one_device_on_the_real_examples(trained):
    """drop: the 5 examples left at the end of a pass are not trained; pad: they are one step
    of 5 (not divisible by 2 towers), padded to 8 with weights 8/5, 0 — the one-device step
    on the 5. Bound: the reference's StepBound, doubled: the weights add two roundings per
    term (S/n and the product), and gamma(n+1) <= 2 gamma(n-1) for n >= 3."""
    drop, trainer, result, (weights, loss_sum, bound) = trained
    assert result.steps == STEPS
    for copy in trainer.copies:
        tolerance.assert_within([v.numpy() for v in copy.trainable], weights,
                                [2 * t for t in bound.weights()])
    assert abs(result.loss_sum - loss_sum) <= 2 * bound.loss_sum
    # accuracy counts the real examples only: 8 + 8 + (8 of the next pass | 5 real) + 8
    assert result.metric_sums["accuracy"][1] == (32 if drop else 29)


@pytest.mark.parametrize("drop", [True, False])
def test_batched_dataset_is_recut_into_the_same_global_batches(drop, logdir):
    config = config_for(logdir, drop)
    examples = as_input(dict_examples(), config)
    batched = as_input(dict_examples().batch(5), config)  # -> rebatched to 8
    assert (examples.description, batched.description) == (
        "a tf.data.Dataset of examples", "a tf.data.Dataset of batches")
    for one, other in zip(examples.train_batches(1).take(5), batched.train_batches(1).take(5)):
        for a, b in zip(tf.nest.flatten(one), tf.nest.flatten(other)):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    first = next(iter(examples.train_batches(2)))  # step 2: the short batch (pad) or step 0
    labels = first[1].labels if not drop else first[1]
    np.testing.assert_array_equal(labels.numpy()[:5], Y[16:21] if not drop else Y[:5])
    if not drop:
        np.testing.assert_allclose(first[1].weights.numpy(), [8 / 5] * 5 + [0, 0, 0])


def test_padding_weights_are_formed_over_the_accumulated_step(logdir):
    """K = 2: step 1 is global batches 2 (5 real, padded to 8) and 3 (the next pass's first
    8): S = 16, n = 13, so the real examples weigh 16/13 and the mean is over the 13."""
    config = helpers.small_config(logdir, devices="cpu:4", global_batch_size=BATCH,
                                  drop_remainder=False, accumulation_steps=2).validated()
    x, y = next(iter(as_input((X, Y), config).train_batches(1)))
    assert x.shape == (16, FEATURES) and y.labels.shape == (16,)
    np.testing.assert_allclose(y.weights.numpy(), [16 / 13] * 5 + [0] * 3 + [16 / 13] * 8)


def test_a_function_gets_its_workers_input_context_and_reads_b_over_w_per_step(logdir):
    """Worker 1 of 2, 2 towers each: InputContext(2 pipelines, id 1, 4 replicas); its own
    examples (here the odd ones, by `shard`) cut into 8 / 2 = 4 per step."""
    config = helpers.small_config(logdir, devices="cpu:2", global_batch_size=BATCH).validated()
    # as Config.validated() resolves it under TF_CONFIG with 2 workers: 4 towers in all
    config = dataclasses.replace(config, batch_size_per_tower=BATCH // 4)
    seen = []

    def worker_data(context):
        seen.append((context.num_input_pipelines, context.input_pipeline_id,
                     context.num_replicas_in_sync))
        return tf.data.Dataset.from_tensor_slices((X, Y)).shard(
            context.num_input_pipelines, context.input_pipeline_id)

    class SecondOfTwo:
        num_workers, index = 2, 1
    source = as_input(worker_data, config, SecondOfTwo())
    steps = [y.numpy() for _, y in source.train_batches(0).take(3)]
    assert seen[-1] == (2, 1, 2 * 2)
    odd = Y[1::2]  # 10 examples: steps of 4, the pass's last 2 dropped
    np.testing.assert_array_equal(np.stack(steps), [odd[0:4], odd[4:8], odd[0:4]])


@pytest.mark.parametrize("given, message", [
    ([1, 2], "train_data: got list [1, 2]; give a tf.data.Dataset"),
    ({"a": X}, "train_data: got a dict of ['a'] with no labels"),
    (tf.data.Dataset.from_tensor_slices((X, Y, Y)), "give elements (features, labels)"),
    (tf.data.Dataset.from_tensor_slices((X, X)),  # every leaf's leading size is 4
     "may be batches or single examples; pass mgloop.data.Batched"),
    (lambda context: [X], "returned list"),
    (tf.data.Dataset.from_tensor_slices((X[:5], Y[:5])), "5 examples are fewer than"),
])
def test_what_is_not_accepted_is_refused_in_one_line(given, message, logdir):
    config = config_for(logdir, True)
    with pytest.raises(ConfigError, match=None) as error:
        as_input(given, config)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_padding_refuses_batch_norm_a_scalar_loss_and_per_worker_functions(logdir):
    config = config_for(logdir, False)
    bn = keras.Sequential([keras.Input((FEATURES,)), keras.layers.BatchNormalization()])
    with pytest.raises(ConfigError, match="BatchNormalization layer"):
        as_input((X, Y), config).check_model(bn)
    with pytest.raises(ConfigError, match="the loss returns one value per batch"):
        padding.weighted_mean(tf.constant(1.0), tf.ones([4]))

    class TwoWorkers:
        num_workers, index = 2, 0
    with pytest.raises(ConfigError, match="on 2 workers"):
        user_input.as_input(lambda context: dict_examples(), config.data,
                            run_inputs.reading(config, TwoWorkers()))


def _weights(logdir_run, data_dir, steps):
    config = helpers.small_config(
        logdir_run, devices="cpu:1", plugins=("tests.plugins.tfrecord_data",),
        dataset="tfrecord_examples", data_dir=data_dir, global_batch_size=4, train_steps=steps,
        steps_per_loop=1, drop_remainder=False, export_dir=os.path.join(logdir_run, "export"))
    mgloop.run(config)  # --model=mlp on the registered dataset, as from the command line
    model = keras.saving.load_model(os.path.join(logdir_run, "export", "model.keras"))
    return [w for w in model.get_weights()]


def test_tfrecord_files_resumed_run_reads_what_an_uninterrupted_run_reads(tmp_path):
    """11 records in two files, global batches of 4, short batches padded: a pass is 3 steps
    (4, 4, 3 real examples), so steps 2, 3 (the short batch, then the next pass's first) differ
    from steps 0, 1; a run resumed at step 2 must read them (the global step in the
    checkpoint is the input position) and end bit for bit where an uninterrupted one does."""
    files = tmp_path / "files"
    files.mkdir()
    tfrecord_data.write(str(files / "train-0.tfrecord"), X[:5], Y[:5])
    tfrecord_data.write(str(files / "train-1.tfrecord"), X[5:11], Y[5:11])
    tfrecord_data.write(str(files / "eval-0.tfrecord"), X[11:], Y[11:])
    whole = _weights(str(tmp_path / "whole"), str(files), 4)
    _weights(str(tmp_path / "resumed"), str(files), 2)
    resumed = _weights(str(tmp_path / "resumed"), str(files), 4)
    for a, b in zip(whole, resumed):
        np.testing.assert_array_equal(a, b)
