"""Bring your own loss, metrics, optimizer and callbacks (issue 16): `mgloop.run`'s API.

Every training case runs mgloop on 2 or 4 towers and the single-device tf.GradientTape
reference (third_party.single_device's step, written out here for nested labels) on
the same global batches, and compares the weights within tests/tolerance.py's bound
(float32 orders of summation); metrics are compared with the Keras metric object on
the global batch of the same weights.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import mgloop
from mgloop.cluster import devices
from mgloop.training import metrics
from mgloop.runs import callbacks, experiment, export
from mgloop.training import losses, training_spec
from mgloop.errors import ConfigError, TensorBranchError
from tests import helpers
from tests import tolerance
from tests.test_accuracy import event_tags

STEPS = 3
SHAPE = helpers.DATASET.input_shape


def dense_model(heads, compile_args=None):
    """Flatten -> Dense(8, tanh) -> one Dense per head; `heads`: [(name, units, activation)]."""
    def make():
        inputs = keras.Input(SHAPE)
        hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Flatten()(inputs))
        outputs = [keras.layers.Dense(units, activation=act, name=name)(hidden)
                   for name, units, act in heads]
        model = keras.Model(inputs, outputs if len(outputs) > 1 else outputs[0])
        if compile_args:
            model.compile(**compile_args)
        return model
    return make


def build(devices_spec, make_model, loss=None, metric_list=None, optimizer=None, **overrides):
    config = helpers.small_config("/unused", devices=devices_spec, aggregation="ring",
                                  **overrides).validated()
    device_set = devices.setup(devices.parse(config.devices, config.towers_per_device))
    return experiment.build_trainer(config, device_set, make_model, loss, SHAPE,
                                    metrics=metric_list, optimizer=optimizer)


def run_steps(trainer, steps):
    """`steps` [(x, y)] (y nested) in one compiled loop; the LoopResult."""
    stacked = tf.nest.map_structure(lambda *a: np.stack(a), *steps)
    result = trainer.train_loop(iter(tf.data.Dataset.from_tensor_slices(stacked)), len(steps))
    assert result.steps == len(steps)
    return result


def reference(make_model, optimizer, loss_fn, steps, per_example_loss, packed=None,
              step_metrics=()):
    """The one-device run: model, bound (tolerance.StepBound with `per_example_loss` on the
    `packed` labels, a single tensor per batch), and `step_metrics` updated on every step's
    outputs (training mode, before the update), as Keras's fit would."""
    experiment.seed_everything(3, True)
    with tf.device("/device:CPU:0"):
        model = make_model()
    bound = tolerance.StepBound()
    for index, (x, y) in enumerate(steps):
        x = tf.constant(x)
        y = tf.nest.map_structure(tf.constant, y)
        bound.before(model, optimizer, per_example_loss, x,
                     tf.constant(packed[index]) if packed is not None else y)
        with tf.GradientTape() as tape:
            outputs = model(x, training=True)
            loss = tf.reduce_mean(loss_fn(y, outputs))
        for metric, pick in step_metrics:
            metric.update_state(*pick(y, outputs))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        bound.after()
    return model, bound


def assert_weights_match(trainer, model, bound):
    for copy in trainer.copies:
        tolerance.assert_within([v.numpy() for v in copy.trainable],
                                [v.numpy() for v in model.trainable_variables], bound.weights())


# --- Keras metric objects: per-tower states merged exactly -------------------------------

def test_keras_metric_states_of_shards_sum_to_the_global_batch_value():
    rng = np.random.default_rng(0)
    y = (rng.random(24) > 0.5).astype(np.float32)
    p = rng.random((24, 1)).astype(np.float32)
    for keras_metric in (keras.metrics.BinaryAccuracy(), keras.metrics.AUC(num_thresholds=50),
                         keras.metrics.MeanSquaredError(), keras.metrics.Precision()):
        wrapped = metrics.KerasMetric(keras_metric)
        shards = [(y[:5], p[:5]), (y[5:16], p[5:16]), (y[16:], p[16:])]  # uneven shards
        summed = sum(wrapped.counts(tf.constant(a), tf.constant(b)).numpy().astype(np.float64)
                     for a, b in shards)
        whole = type(keras_metric).from_config(keras_metric.get_config())
        whole.update_state(y, p)
        assert wrapped.result(summed) == pytest.approx(float(whole.result()), rel=1e-6)


@pytest.mark.parametrize("bad, words", [
    (keras.metrics.R2Score(), "builds its state on its first batch"),
    (keras.metrics.F1Score(), "builds its state on its first batch")])
def test_metrics_whose_state_cannot_be_merged_are_refused(bad, words):
    with pytest.raises(ConfigError, match=words):
        metrics.KerasMetric(bad)


def test_bad_arguments_are_refused_in_one_line():
    model = dense_model([("out", 1, None)], dict(loss="mse", weighted_metrics=["mae"]))()
    cases = [
        (lambda: training_spec.check_arguments(3, None, None, None), "loss: got int"),
        (lambda: training_spec.check_arguments(None, "accuracy", None, None), "metrics: got str"),
        (lambda: training_spec.check_arguments(None, None, 0.1, None), "optimizer: got float"),
        (lambda: training_spec.check_arguments(None, None, None, [3]), "callbacks: 3 is not"),
        (lambda: training_spec.compiled_settings(model), "weighted_metrics"),
        (lambda: training_spec.make_metrics(["accuracy"], keras.losses.mean_squared_error,
                                            model), "'accuracy' .* not defined by its loss"),
        (lambda: training_spec.make_metrics([keras.metrics.MeanSquaredError(name="loss")],
                                            None, model), "used twice \\(or are 'loss'\\)"),
        (lambda: training_spec.optimizer_factory(lambda: 0.1)(), "returned float"),
        (lambda: callbacks.EarlyStopping(mode="up"), "mode='up'"),
        (lambda: callbacks.check([callbacks.EarlyStopping()], 0), "--eval_every=0 evaluates"),
        (lambda: callbacks.check([callbacks.EarlyStopping()], 5, False), "no eval data"),
        (lambda: training_spec.make_loss(["mse", "mae"], model), "loss: given per output"),
        (lambda: training_spec.make_metrics({"out": ["mae"]}, None, model),
         "metrics: given per output")]
    for call, words in cases:
        with pytest.raises(ConfigError, match=words) as raised:
            call()
        assert "\n" not in str(raised.value)


def test_compiled_losses_per_output_take_the_compiled_loss_weights():
    model = dense_model([("cls", 10, None), ("reg", 1, None)], dict(
        loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              "reg": "mse"}, loss_weights={"cls": 0.25, "reg": 2.0}))()
    spec = training_spec.resolve(model, None, None, None, losses.cross_entropy, None)
    assert spec.sources["loss"] == "compiled model"
    rng = np.random.default_rng(1)
    logits, value = rng.normal(size=(6, 10)).astype(np.float32), rng.normal(size=(6, 1))
    labels, target = rng.integers(0, 10, 6), rng.normal(size=(6, 1))
    expected = (0.25 * np.mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
                + 2.0 * np.mean((value - target) ** 2))
    got = spec.loss_fn((labels, target.astype(np.float32)),
                       [tf.constant(logits), tf.constant(value, tf.float32)])
    assert got.shape == [6]  # per example, so short batches can be padded (data/padding.py)
    assert float(np.mean(got)) == pytest.approx(expected, rel=1e-6)


def test_optimizer_names_and_factories_make_a_fresh_optimizer_per_copy():
    for given in ("adam", lambda: keras.optimizers.Adam(0.01), keras.optimizers.Adam(0.01)):
        make = training_spec.optimizer_factory(given)
        first, second = make(), make()
        assert isinstance(first, keras.optimizers.Adam) and first is not second
        settings = [{k: v for k, v in o.get_config().items() if k != "name"}
                    for o in (first, second)]
        assert settings[0] == settings[1]


# --- heads, labels and losses against one device -----------------------------------------

def test_sigmoid_head_accuracy_is_binary_accuracy_on_the_global_batch():
    """Sigmoid output, the default loss (Keras's binary cross-entropy on probabilities):
    train accuracy equals keras.metrics.BinaryAccuracy over the reference's step outputs,
    eval accuracy equals it on the trained model's predictions (threshold 0.5, not 0)."""
    steps = [(x, (y % 2).astype(np.float32)) for x, y in helpers.batches(STEPS)]
    make = dense_model([("out", 1, "sigmoid")])
    trainer = build("cpu:2", make)
    result = run_steps(trainer, steps)
    assert [m.name for m in trainer.metrics] == ["accuracy"]
    binary = keras.metrics.BinaryAccuracy()
    bce = lambda y, o: keras.losses.binary_crossentropy(y[:, None], o)  # noqa: E731
    model, bound = reference(make, keras.optimizers.SGD(0.1, momentum=0.9), bce, steps, bce,
                             step_metrics=[(binary, lambda y, o: (y[:, None], o))])
    assert_weights_match(trainer, model, bound)
    train = metrics.results(trainer.metrics, result.metric_sums)["accuracy"]
    assert train == pytest.approx(float(binary.result()), abs=1e-7)
    x_eval = helpers.DATASET.eval_x
    y_eval = (helpers.DATASET.eval_y % 2).astype(np.float32)
    evaluated = trainer.evaluate(tf.data.Dataset.from_tensor_slices((x_eval, y_eval)).batch(24))
    on_model = keras.metrics.BinaryAccuracy()
    on_model.update_state(y_eval[:, None], trainer.model(x_eval, training=False))
    assert evaluated["accuracy"] == pytest.approx(float(on_model.result()), abs=1e-7)


def test_one_hot_labels_train_as_integer_labels():
    integer_steps = helpers.batches(STEPS)
    steps = [(x, np.eye(10, dtype=np.float32)[y]) for x, y in integer_steps]
    make = dense_model([("out", 10, None)])
    trainer = build("cpu:2", make)
    result = run_steps(trainer, steps)

    def one_hot_loss(y, logits):
        return tf.nn.softmax_cross_entropy_with_logits(y, logits)
    model, bound = reference(make, keras.optimizers.SGD(0.1, momentum=0.9), one_hot_loss,
                             steps, one_hot_loss)
    assert_weights_match(trainer, model, bound)
    counts = result.metric_sums["accuracy"]
    assert counts[1] == STEPS * helpers.GLOBAL_BATCH  # one comparison per example


def test_a_loss_branching_on_a_tensor_is_named_in_one_line_and_trains_as_a_tf_function():
    """The step is traced without AutoGraph, as Keras's fit traces its train step
    (runs/loop.py): a loss with `if tensor:` is refused in one line naming that line; the
    same loss made a tf.function (which AutoGraph converts) trains as one device."""
    make = dense_model([("out", 10, None)])

    def branching(y, logits):
        per_example = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        if tf.reduce_mean(per_example) > 1e6:  # never taken: the loss is the cross-entropy
            per_example = per_example * 0.0
        return per_example
    with pytest.raises(TensorBranchError) as error:
        run_steps(build("cpu:2", make, loss=branching), helpers.batches(1))
    message = str(error.value)
    assert "\n" not in message, message
    assert f"{os.path.basename(__file__)}:" in message and "if tf.reduce_mean(per_example)" in message
    steps = helpers.batches(STEPS)
    trainer = build("cpu:2", make, loss=tf.function(branching))
    run_steps(trainer, steps)
    model, bound = reference(make, keras.optimizers.SGD(0.1, momentum=0.9), branching, steps,
                             branching)
    assert_weights_match(trainer, model, bound)


def test_compiled_softmax_model_trains_with_its_loss_metrics_and_optimizer():
    make = dense_model([("out", 10, "softmax")], dict(
        optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy",
        metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=3, name="top3")]))
    trainer = build("cpu:4", make)
    assert trainer.spec.sources == {"loss": "compiled model", "metrics": "compiled model",
                                    "optimizer": "compiled model"}
    assert isinstance(trainer.copies[0].optimizer, keras.optimizers.Adam)
    steps = helpers.batches(STEPS)
    result = run_steps(trainer, steps)
    accuracy, top3 = (keras.metrics.SparseCategoricalAccuracy(),
                      keras.metrics.SparseTopKCategoricalAccuracy(k=3))
    loss = keras.losses.sparse_categorical_crossentropy
    model, bound = reference(make, keras.optimizers.Adam(0.01), loss, steps, loss,
                             step_metrics=[(accuracy, lambda y, o: (y, o)),
                                           (top3, lambda y, o: (y, o))])
    assert_weights_match(trainer, model, bound)
    values = metrics.results(trainer.metrics, result.metric_sums)
    assert values["accuracy"] == pytest.approx(float(accuracy.result()), abs=1e-7)
    assert values["top3"] == pytest.approx(float(top3.result()), abs=1e-7)


def test_two_outputs_with_two_losses_and_loss_weights():
    """A class head (logits) and a regression head; loss = 1.0 * CE + 0.5 * MSE as compile
    weighs them; per-output metrics named <output>_<metric>."""
    make = dense_model([("cls", 10, None), ("reg", 1, None)])
    weights = {"cls": 1.0, "reg": 0.5}
    loss = losses.PerOutput(
        {"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"},
        weights)
    trainer = build("cpu:2", make, loss=loss,
                    metric_list={"cls": ["accuracy"], "reg": [keras.metrics.MeanAbsoluteError()]})
    assert [m.name for m in trainer.metrics] == ["cls_accuracy", "reg_mean_absolute_error"]
    plain = helpers.batches(STEPS)
    steps = [(x, (y, (y / 10.0).astype(np.float32)[:, None])) for x, y in plain]

    def per_example(packed, outputs):  # labels packed as [B, 2]: class, target
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.cast(packed[:, 0], tf.int32),
                                                            outputs[0])
        return ce + 0.5 * tf.square(outputs[1][:, 0] - packed[:, 1])

    def mean_loss(y, outputs):
        return (tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y[0], outputs[0]))
                + 0.5 * tf.reduce_mean(tf.square(outputs[1] - y[1])))
    result = run_steps(trainer, steps)
    packed = [np.stack([y.astype(np.float32), y / 10.0], 1).astype(np.float32) for _, y in plain]
    mae = keras.metrics.MeanAbsoluteError()
    model, bound = reference(make, keras.optimizers.SGD(0.1, momentum=0.9), mean_loss, steps,
                             per_example, packed, step_metrics=[(mae, lambda y, o: (y[1], o[1]))])
    assert_weights_match(trainer, model, bound)
    values = metrics.results(trainer.metrics, result.metric_sums)
    assert values["reg_mean_absolute_error"] == pytest.approx(float(mae.result()), rel=1e-5)
    assert result.metric_sums["cls_accuracy"][1] == STEPS * helpers.GLOBAL_BATCH


def test_regression_with_mse_reports_its_metrics_and_no_accuracy():
    make = dense_model([("out", 1, None)])
    steps = [(x, (y / 10.0).astype(np.float32)) for x, y in helpers.batches(STEPS)]
    trainer = build("cpu:2", make, loss=keras.losses.MeanSquaredError(),
                    metric_list=[keras.metrics.MeanAbsoluteError(name="mae")])
    result = run_steps(trainer, steps)
    mae = keras.metrics.MeanAbsoluteError()
    per_example = keras.losses.mean_squared_error
    model, bound = reference(make, keras.optimizers.SGD(0.1, momentum=0.9),
                             lambda y, o: per_example(y[:, None], o), steps,
                             lambda y, o: per_example(y[:, None], o),
                             step_metrics=[(mae, lambda y, o: (y[:, None], o))])
    assert_weights_match(trainer, model, bound)
    values = metrics.results(trainer.metrics, result.metric_sums)
    assert set(values) == {"mae"}  # no accuracy
    assert values["mae"] == pytest.approx(float(mae.result()), rel=1e-5)


# --- optimizers ------------------------------------------------------------------------

def test_keras_optimizer_object_with_a_schedule_gives_each_copy_its_own():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.2, decay_steps=1, decay_rate=0.5)
    given = keras.optimizers.SGD(schedule, momentum=0.9)
    make = dense_model([("out", 10, None)])
    trainer = build("cpu:2", make, loss=helpers.experiment.default_loss(), optimizer=given)
    first, second = (copy.optimizer for copy in trainer.copies)
    assert first is not second and given not in (first, second)
    steps = helpers.batches(STEPS)
    run_steps(trainer, steps)
    assert int(given.iterations.numpy()) == 0  # the object given is a template, never applied
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    per_example = lambda y, o: keras.losses.sparse_categorical_crossentropy(y, o, True)  # noqa
    model, bound = reference(make, keras.optimizers.SGD(schedule, momentum=0.9), loss, steps,
                             per_example)
    assert_weights_match(trainer, model, bound)
    from mgloop.training import optim
    assert optim.current_rate(first)(STEPS) == pytest.approx(0.2 * 0.5 ** STEPS, rel=1e-6)


# --- run: callbacks, the result object ------------------------------------------------

def test_run_stops_early_calls_back_and_returns_a_usable_model(tmp_path):
    """numpy regression data, a model compiled with MSE and MAE (and an optimizer the run
    overrides): no accuracy anywhere; EarlyStopping with a min_delta no eval can beat stops
    after its patience (evals at steps 1, 2, 3: best at 1, then 2 evals without improvement
    > patience 1); the user's function sees every loop's step and metrics; the result's
    model predicts as the export."""
    seen = []

    def record(step, values):
        seen.append((step, sorted(values)))

    source = helpers.DATASET
    train = (source.train_x, (source.train_y / 10.0).astype(np.float32)[:, None])
    evaluation = (source.eval_x, (source.eval_y / 10.0).astype(np.float32)[:, None])
    stopper = callbacks.EarlyStopping("eval/loss", patience=1, min_delta=1e9)
    config = helpers.small_config(str(tmp_path / "run"), train_steps=8,
                                  steps_per_loop=1, eval_every=1, summary_every=1,
                                  export_dir=str(tmp_path / "export"))
    make = dense_model([("out", 1, None)], dict(optimizer="adam", loss="mse",
                                                 metrics=[keras.metrics.MeanAbsoluteError()]))
    result = mgloop.run(config, model_fn=make, train_data=train, eval_data=evaluation,
                        optimizer=keras.optimizers.SGD(0.05), callbacks=[stopper, record])
    assert result["final_step"] == 3 and stopper.stopped_step == 3
    assert result["stopped_by"] == repr(stopper)
    assert [step for step, _ in seen] == [1, 2, 3]
    assert seen[0][1] == sorted(["eval/loss", "eval/mean_absolute_error", "train/loss",
                                 "train/mean_absolute_error", "train/examples_per_sec",
                                 "train/step_time", "train/input_wait"])
    steps, losses_seen = result.history.of("eval/loss")
    assert steps == [1, 2, 3] and losses_seen[-1] == pytest.approx(result["eval_loss"])
    assert set(result["eval_metrics"]) == {"loss", "mean_absolute_error"}
    assert result["training"]["optimizer"] == "run"
    assert result["training"]["loss"] == result["training"]["metrics_from"] == "compiled model"
    assert result["eval_accuracy"] is None and result["final_train_accuracy"] is None
    for folder in ("train", "eval"):
        tags = event_tags(str(tmp_path / "run" / folder))
        assert {"loss", "mean_absolute_error"} <= tags and "accuracy" not in tags
    assert "learning_rate" in event_tags(str(tmp_path / "run" / "train"))
    exported = keras.models.load_model(os.path.join(str(tmp_path / "export"),
                                                    export.EXPORT_FILENAME), compile=False)
    x = source.eval_x[:20]
    expected = exported.predict(x, verbose=0)  # the same Keras path: equal bits
    np.testing.assert_array_equal(result.model.predict(x, verbose=0), expected)
    # the towers' prediction: the same weights, another batch split (float32 sum order)
    np.testing.assert_allclose(result.predict(x, batch_size=8), expected, rtol=1e-6, atol=1e-7)


def test_the_removed_argument_names_are_refused_by_name(logdir):
    """`loss_fn=` and `dataset=` were renamed `loss=` and `train_data=` (docs/moved.md)."""
    config = helpers.small_config(logdir)
    for old in ("loss_fn", "dataset"):
        with pytest.raises(TypeError, match=f"'{old}'"):
            mgloop.run(config, **{old: keras.losses.MeanSquaredError()})


def test_two_outputs_on_a_padded_short_batch_train_on_the_real_examples():
    """A loss per output is per example (losses.PerOutput), so a short batch padded to the
    global batch with weights (data/padding.py) trains as one device on its real examples."""
    from mgloop.data import padding
    make = dense_model([("cls", 10, None), ("reg", 1, None)])
    loss = losses.PerOutput([keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                             keras.losses.MeanSquaredError()], [1.0, 0.5])
    trainer = build("cpu:2", make, loss=loss, metric_list=[])
    (x, y), = helpers.batches(1)
    real = 11  # of 16: the short batch, padded with copies of its first examples
    index = np.arange(helpers.GLOBAL_BATCH) % real
    target = (y / 10.0).astype(np.float32)[:, None]
    mask = (np.arange(helpers.GLOBAL_BATCH) < real).astype(np.float32)
    weights = mask * helpers.GLOBAL_BATCH / real
    run_steps(trainer, [(x[index], padding.Weighted((y[index], target[index]), weights))])

    def per_example(packed, outputs):
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(tf.cast(packed[:, 0], tf.int32),
                                                            outputs[0])
        return ce + 0.5 * tf.square(outputs[1][:, 0] - packed[:, 1])
    packed = np.stack([y[:real].astype(np.float32), target[:real, 0]], 1)
    model, bound = reference(make, keras.optimizers.SGD(0.1, momentum=0.9),
                             lambda labels, o: per_example(packed, o),
                             [(x[:real], (y[:real], target[:real]))], per_example, [packed])
    assert_weights_match(trainer, model, bound)


def test_a_schedule_is_shared_not_serialized_and_one_without_a_config_refused():
    @keras.saving.register_keras_serializable(package="test_byo_api")
    class Halving(keras.optimizers.schedules.LearningRateSchedule):
        def __init__(self, start):
            self.start = start

        def __call__(self, step):
            return self.start * tf.pow(0.5, tf.cast(step, tf.float32))

        def get_config(self):
            return {"start": self.start}

    schedule = Halving(0.4)
    make = training_spec.optimizer_factory(keras.optimizers.SGD(schedule))
    first, second = make(), make()
    assert first is not second and first._learning_rate is schedule  # noqa: SLF001

    class NoConfig(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return 0.1

    with pytest.raises(ConfigError, match="cannot be remade from its config .* factory"):
        training_spec.optimizer_factory(keras.optimizers.SGD(NoConfig()))


def test_history_keeps_evals_and_summary_steps_and_early_stopping_counts_evals():
    history = callbacks.History(every=4)
    stopper = callbacks.EarlyStopping("eval/accuracy", patience=1, mode="max")
    stopped = []
    for step, value in zip(range(1, 9), (None, 0.5, None, 0.6, None, 0.6, 0.55, None)):
        metrics_seen = {"train/loss": 1.0 / step}
        if value is not None:
            metrics_seen["eval/accuracy"] = value
        history(step, metrics_seen)
        if stopper(step, metrics_seen):
            stopped.append(step)
    assert [r["step"] for r in history.records] == [2, 4, 6, 7, 8]
    assert history.of("eval/accuracy") == ([2, 4, 6, 7], [0.5, 0.6, 0.6, 0.55])
    assert stopped == [7] and stopper.best == 0.6 and stopper.best_step == 4
