"""The benchmark's models: sizes from their layer formulas, one training step, loadable exports."""

import numpy as np
import pytest
import keras
import tensorflow as tf

from mgloop import Config, ConfigError, data, models
from mgloop.training import losses
from mgloop.data import random_binary
from tests import helpers, tolerance


def dense_parameters(widths):
    """Kernel and bias of each Dense layer of a chain of widths."""
    return sum(fan_in * fan_out + fan_out for fan_in, fan_out in zip(widths, widths[1:]))


def resnet20_parameters(classes=10):
    """Convs without bias (k*k*in*out), BN gamma/beta/mean/variance (4*c), the 1x1 shortcut
    convs where the shape changes, the final Dense."""
    total = 3 * 3 * 3 * 16 + 4 * 16
    channels = 16
    for filters in (16, 32, 64):
        for block in range(3):
            total += 3 * 3 * channels * filters + 4 * filters
            total += 3 * 3 * filters * filters + 4 * filters
            if channels != filters:
                total += channels * filters + 4 * filters
            channels = filters
    return total + 64 * classes + classes


def count(variables):
    return sum(int(np.prod(v.shape)) for v in variables)


def test_the_mlps_own_settings_shape_it_and_are_refused_with_another_model(tmp_path):
    """--mlp_width and --mlp_depth reach the builder; unset, the run records the builder's
    defaults (128, 2); set with another model, or below 1, they are refused in one line."""
    base = dict(logdir=str(tmp_path / "run"), devices="cpu:1")
    config = Config(**base, mlp_width=16, mlp_depth=3).validated()
    model = models.builder_of(config.models, (8, 8), 10)()
    assert len(model.trainable_variables) == 2 * 3 + 2
    assert model.count_params() == dense_parameters([64, 16, 16, 16, 10])
    default = Config(**base).validated()
    assert (default.mlp_width, default.mlp_depth) == (128, 2)
    for settings, message in [
            (dict(model="cnn", mlp_depth=1), r"^--mlp_depth=1 is set but only --model=mlp "
                                             r"reads it, not --model=cnn; drop --mlp_depth$"),
            (dict(mlp_width=0), r"^--mlp_width=0 is out of range")]:
        with pytest.raises(ConfigError, match=message):
            Config(**base, **settings).validated()


def test_big_mlp_has_the_posts_41_million_parameters():
    model = models.get("big_mlp")((8000,), 2)
    assert model.count_params() == dense_parameters([8000, 4000, 2000, 500, 300, 1])
    assert model.count_params() == 41_157_101  # the figure the post quotes from Keras
    assert model.output_shape == (None, 1)
    activations = [layer.activation.__name__ for layer in model.layers
                   if isinstance(layer, keras.layers.Dense)]
    assert activations == ["tanh", "relu", "relu", "relu", "linear"]  # sigmoid: in the loss


def test_resnet20_and_minigooglenet_sizes():
    resnet = models.get("resnet20")((32, 32, 3), 10)
    assert resnet.count_params() == resnet20_parameters() == 274_042
    convs = [layer for layer in resnet.layers
             if isinstance(layer, keras.layers.Conv2D) and layer.kernel_size != (1, 1)]
    assert len(convs) + 1 == 20  # 19 3x3 convolutions and the Dense layer
    googlenet = models.get("minigooglenet")((32, 32, 3), 10)
    assert googlenet.count_params() == 1_656_250  # documented in mgloop/models/minigooglenet.py
    assert count(googlenet.non_trainable_variables) - 2 == 3_424  # BN statistics (+ Dropout seed)


@pytest.mark.parametrize("model,dataset,batch", [
    ("big_mlp", random_binary.make(seed=1, num_train=64, num_eval=8), 8),
    ("resnet20", data.synthetic.make(seed=1, num_train=64, num_eval=8, input_shape=(32, 32, 3)), 8),
    ("minigooglenet", data.synthetic.make(seed=1, num_train=64, num_eval=8,
                                          input_shape=(32, 32, 3)), 8)])
def test_one_step_on_two_towers(model, dataset, batch, logdir):
    config = helpers.small_config(logdir, devices="cpu:2", aggregation="reduce_broadcast",
                                  model=model, global_batch_size=batch, learning_rate=0.01)
    make = lambda: models.get(model)(dataset.input_shape, dataset.num_classes)  # noqa: E731
    trainer = helpers.build_trainer(config, make, input_shape=dataset.input_shape)
    before = [v.numpy() for v in trainer.copies[0].trainable]
    x, y = next(iter(dataset.train_batches(batch, seed=0)))
    loss = helpers.run_batches(trainer, [(x.numpy(), y.numpy())])
    assert np.isfinite(loss) and loss > 0
    after = [v.numpy() for v in trainer.copies[0].trainable]
    assert any(np.abs(a - b).max() > 0 for a, b in zip(after, before))
    for replica in trainer.copies[1:]:
        for a, b in zip(replica.variables, trainer.copies[0].variables):
            np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("model", ["resnet20", "minigooglenet"])
def test_export_loads_with_plain_keras(model, tmp_path):
    built = models.get(model)((32, 32, 3), 10)
    path = str(tmp_path / "model.keras")
    built.save(path)
    loaded = keras.models.load_model(path)
    for mine, theirs in zip(loaded.weights, built.weights):  # saved and read back bit for bit
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
    x = np.random.default_rng(0).standard_normal((2, 32, 32, 3)).astype(np.float32)
    # Exactly equal on any CPU: the same layers run the same TF ops on the same shapes,
    # bit-identical weights and inputs, in one process; with op determinism on, TF
    # guarantees an op the same output bits for the same inputs on the same machine.
    tf.config.experimental.enable_op_determinism()
    np.testing.assert_array_equal(loaded(x, training=False), built(x, training=False))


def test_cross_entropy_is_binary_for_one_logit_and_categorical_otherwise():
    """Against the exact (float64) values, within the float32 bounds of
    tolerance.sigmoid_cross_entropy_bound and softmax_cross_entropy_bound."""
    rng = np.random.default_rng(0)
    labels = np.array([0, 1, 1, 0], np.int32)
    one = rng.standard_normal((4, 1)).astype(np.float32)
    z = one[:, 0].astype(np.float64)
    expected = -(labels * np.log(1 / (1 + np.exp(-z)))
                 + (1 - labels) * np.log(1 - 1 / (1 + np.exp(-z))))
    tolerance.assert_within([losses.cross_entropy(labels, one).numpy()], [expected],
                            [tolerance.sigmoid_cross_entropy_bound(z)])
    many = rng.standard_normal((4, 3)).astype(np.float32)
    z = many.astype(np.float64)
    softmax = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    tolerance.assert_within([losses.cross_entropy(labels, many).numpy()],
                            [-np.log(softmax[np.arange(4), labels])],
                            [tolerance.softmax_cross_entropy_bound(z)])
    # Far from zero the one-logit form stays finite where log(sigmoid(z)) underflows.
    big = tf.constant([[-200.0]])
    assert np.isfinite(losses.cross_entropy(np.array([1]), big).numpy()).all()


def test_random_binary_labels_are_a_balanced_function_of_the_inputs():
    dataset = random_binary.make(seed=3, num_train=1024, num_eval=16)
    assert dataset.input_shape == (8000,) and dataset.num_classes == 2
    assert 0.4 < dataset.train_y.mean() < 0.6
    again = random_binary.make(seed=3, num_train=1024, num_eval=16)
    np.testing.assert_array_equal(dataset.train_y, again.train_y)
    # The documented rule: y = [w . (x - 1/2) > 0], w the seed's first N(0, I) draw.
    direction = np.random.default_rng(3).standard_normal(8000).astype(np.float32)
    for x, y in ((dataset.train_x, dataset.train_y), (dataset.eval_x, dataset.eval_y)):
        np.testing.assert_array_equal(y, ((x - 0.5) @ direction > 0).astype(np.int32))
