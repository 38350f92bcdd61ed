"""Accuracy is reported only where the loss defines it, and then as one device would
count it (issue 12, item 3): probabilities or logits, tokens, multi-label, one-hot.

Expected values are counted in numpy from the template model's own outputs on the
same examples: before a step for the training count (no dropout or batch norm
here, so the training forward equals inference), after it for evaluation.
"""

import dataclasses
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from mgloop.runs import experiment
from tests import helpers

TOKENS, VOCAB = 8, 12


def event_tags(folder):
    """The tags of every event in the event files of `folder` (not its subfolders)."""
    return {value.tag for name in os.listdir(folder) if name.startswith("events")
            for event in tf.compat.v1.train.summary_iterator(os.path.join(folder, name))
            for value in event.summary.value}


def one_step(trainer, x, y):
    """The trainer's LoopResult of one step on the global batch (x, y)."""
    stream = tf.data.Dataset.from_tensor_slices((x[None], y[None]))
    return trainer.train_loop(iter(stream), 1)


def eval_batches(x, y, batch=8):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)  # 19 examples: 8, 8, 3


def dense_head(units, activation):
    shape = helpers.DATASET.input_shape
    return lambda: keras.Sequential([
        keras.Input(shape), keras.layers.Flatten(), keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(units, activation=activation)])


def bits(y, width):
    """Multi-label 0/1 targets: the low `width` bits of the class id."""
    return ((y[:, None] >> np.arange(width)) & 1).astype(np.float32)


@pytest.mark.parametrize("units,activation,loss_fn,threshold", [
    (1, "sigmoid", None, 0.5),
    (1, None, None, 0.0),
    (1, "sigmoid", keras.losses.BinaryCrossentropy(), 0.5),
    (3, "sigmoid", None, 0.5),  # multi-label: one comparison per unit
    (3, None, keras.losses.BinaryCrossentropy(from_logits=True), 0.0),
], ids=["sigmoid", "one-logit", "sigmoid-keras-loss", "multi-label", "multi-label-logits"])
def test_binary_accuracy_thresholds_what_the_model_outputs(units, activation, loss_fn,
                                                           threshold, logdir):
    labels = (lambda y: (y % 2).astype(np.float32)) if units == 1 else (lambda y: bits(y, 3))
    x, y = helpers.batches(1)[0]
    y = labels(y)
    config = helpers.small_config(logdir, devices="cpu:2", aggregation="ring")
    trainer = helpers.build_trainer(config, dense_head(units, activation), loss_fn)
    outputs = trainer.model(x).numpy()
    right = (outputs > threshold) == (y.reshape(outputs.shape) > 0.5)
    if units == 1 and activation == "sigmoid":
        assert np.mean(right) != np.mean(y)  # the premise: not the fraction of positives
    result = one_step(trainer, x, y)
    assert tuple(result.metric_sums["accuracy"]) == (np.sum(right), right.size)

    eval_x, eval_y = helpers.DATASET.eval_x[:19], labels(helpers.DATASET.eval_y[:19])
    outputs = trainer.model(eval_x).numpy()
    expected = np.mean((outputs > threshold) == (eval_y.reshape(outputs.shape) > 0.5))
    assert trainer.evaluate(eval_batches(eval_x, eval_y))["accuracy"] == pytest.approx(
        expected, abs=1e-12)


def token_model():
    tokens = keras.Input((TOKENS,), dtype="int32")
    hidden = keras.layers.Embedding(VOCAB, 16)(tokens)
    return keras.Model(tokens, keras.layers.Dense(VOCAB)(hidden))  # [B, L, K] logits


def token_data(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, size=(n, TOKENS), dtype=np.int32)
    return x, ((x + rng.integers(0, 2, size=x.shape)) % VOCAB).astype(np.int32)


def token_accuracy(model, x, y):
    predicted = np.argmax(model(x).numpy(), axis=-1)
    return predicted == y


@pytest.mark.parametrize("aggregation,loss_fn", [
    ("ring", None),
    ("ring", keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
    ("colocate", None),
])
def test_sequence_accuracy_is_over_tokens(aggregation, loss_fn, logdir):
    config = helpers.small_config(logdir, devices="cpu:2", aggregation=aggregation)
    trainer = helpers.build_trainer(config, token_model, loss_fn, input_shape=(TOKENS,))
    x, y = token_data(helpers.GLOBAL_BATCH, seed=1)
    right = token_accuracy(trainer.model, x, y)
    result = one_step(trainer, x, y)
    assert tuple(result.metric_sums["accuracy"]) == (np.sum(right),
                                                      helpers.GLOBAL_BATCH * TOKENS)

    eval_x, eval_y = token_data(19, seed=2)
    expected = np.mean(token_accuracy(trainer.model, eval_x, eval_y))
    assert 0 < expected < 1
    assert trainer.evaluate(eval_batches(eval_x, eval_y))["accuracy"] == pytest.approx(
        expected, abs=1e-12)


def test_one_hot_labels_agree_with_integer_labels(logdir):
    config = helpers.small_config(logdir, devices="cpu:2", aggregation="ps_cpu")
    steps = helpers.batches(2)
    as_one_hot = [(x, np.eye(helpers.DATASET.num_classes, dtype=np.float32)[y]) for x, y in steps]
    eval_x, eval_y = helpers.DATASET.eval_x[:19], helpers.DATASET.eval_y[:19]
    eval_one_hot = np.eye(helpers.DATASET.num_classes, dtype=np.float32)[eval_y]
    runs = []
    for loss_fn, batches, labels in [
            (None, steps, eval_y), (None, as_one_hot, eval_one_hot),
            (keras.losses.CategoricalCrossentropy(from_logits=True), as_one_hot, eval_one_hot)]:
        trainer = helpers.build_trainer(config, loss_fn=loss_fn)
        results = [one_step(trainer, x, y) for x, y in batches]
        runs.append(([tuple(r.metric_sums["accuracy"]) for r in results],
                     [r.loss_sum for r in results],
                     trainer.evaluate(eval_batches(eval_x, labels))))
    (counts, loss_sums, metrics), others = runs[0], runs[1:]
    assert [c for _, c in counts] == [helpers.GLOBAL_BATCH] * 2
    # The three losses are one real function (one-hot rows pick the same log-probability;
    # products by 0 and 1 are exact), rounded along other paths: each run's step loss is
    # within the one-device run's float32 bound (tests/tolerance.py, StepBound.loss_sum
    # bounds every step's), so two runs within twice that.
    _, _, bound = helpers.train_reference_bounded(config, steps)
    for other_counts, other_losses, other_metrics in others:
        assert other_counts == counts
        for other_loss, loss in zip(other_losses, loss_sums):
            assert abs(other_loss - loss) <= 2 * bound.loss_sum
        assert other_metrics["accuracy"] == metrics["accuracy"]


def regression_model():
    shape = helpers.DATASET.input_shape
    return keras.Sequential([keras.Input(shape), keras.layers.Flatten(), keras.layers.Dense(1)])


def test_regression_reports_no_accuracy_anywhere(logdir):
    source = helpers.DATASET
    dataset = dataclasses.replace(source, train_y=source.train_y.astype(np.float32),
                                  eval_y=source.eval_y.astype(np.float32))
    config = helpers.small_config(logdir, train_steps=2, steps_per_loop=1, summary_every=1,
                                  log_every=1)
    summary = experiment.run(config, model_fn=regression_model,
                             loss=keras.losses.MeanSquaredError(), train_data=dataset)
    assert summary["final_train_accuracy"] is None and summary["eval_accuracy"] is None
    assert summary["final_train_loss"] > 0
    with open(os.path.join(logdir, experiment.SUMMARY_FILENAME)) as handle:
        written = json.load(handle)
    assert written["eval_accuracy"] is None and written["final_train_accuracy"] is None
    for run in ("train", "eval"):
        tags = event_tags(os.path.join(logdir, run))
        assert "loss" in tags and "accuracy" not in tags
    root = event_tags(logdir)
    assert "final/train_loss" in root and "final/eval_accuracy" not in root
