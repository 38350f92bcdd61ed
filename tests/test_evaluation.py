"""Evaluation and prediction split over the towers equal the single-device answer.

Tolerances (tests/tolerance.py): the logits of the towers and of one device are within
logit_bound (2 gamma(n) times the absolute forward pass), the mean loss within
mean_loss_bound; a reordering of examples moves logits by ~1e-1, far outside.
"""

import numpy as np
import pytest
import tensorflow as tf

from mgloop.runs import experiment
from tests import helpers
from tests import tolerance

EVAL_X = helpers.DATASET.eval_x[:19]
EVAL_Y = helpers.DATASET.eval_y[:19]
BATCH = 8  # 19 examples: batches of 8, 8 and 3 (3 < 4 towers)


def trained(logdir, aggregation):
    config = helpers.small_config(logdir, devices="cpu:4", aggregation=aggregation)
    trainer = helpers.build_trainer(config)
    helpers.run_batches(trainer, helpers.batches(3))
    return trainer


def single_device(trainer):
    """The template model on all 19 examples at once, on one device."""
    with tf.device("/device:CPU:0"):
        logits = trainer.model(EVAL_X, training=False).numpy()
    losses = np.mean(experiment.default_loss()(EVAL_Y, logits).numpy())  # the mean over 19
    accuracy = np.mean(np.argmax(logits, axis=-1) == EVAL_Y)
    return logits, float(losses), float(accuracy)


@pytest.mark.parametrize("aggregation", ["ps_cpu", "ring"])
def test_ragged_eval_on_four_towers_equals_one_device(aggregation, logdir):
    trainer = trained(logdir, aggregation)
    batches = tf.data.Dataset.from_tensor_slices((EVAL_X, EVAL_Y)).batch(BATCH)
    assert [int(y.shape[0]) for _, y in batches] == [8, 8, 3]
    metrics = trainer.evaluate(batches)
    _, loss, accuracy = single_device(trainer)
    losses = experiment.default_loss()(EVAL_Y, trainer.model(EVAL_X)).numpy()
    assert abs(metrics["loss"] - loss) <= tolerance.mean_loss_bound(trainer.model, EVAL_X,
                                                                      losses)
    assert metrics["accuracy"] == accuracy
    assert 0.0 < accuracy < 1.0  # an accuracy that can be wrong both ways


def test_an_eval_set_traces_once_per_count_of_towers_in_use_whatever_its_batch_sizes(logdir):
    """Batches of 8, 8 and 3 on 4 towers: one trace for the 4 towers the full batches use,
    one for the 3 of the last (a trace per batch size would retrace for each shorter last
    batch); then batches of 5, 5, 5 and 4 trace nothing more."""
    trainer = trained(logdir, "ring")
    evaluate_batch = trainer.inference._eval_batch
    trainer.evaluate(tf.data.Dataset.from_tensor_slices((EVAL_X, EVAL_Y)).batch(BATCH))
    assert evaluate_batch.experimental_get_tracing_count() == 2
    trainer.evaluate(tf.data.Dataset.from_tensor_slices((EVAL_X[:19], EVAL_Y[:19])).batch(5))
    assert evaluate_batch.experimental_get_tracing_count() == 2


def test_eval_of_fewer_examples_than_towers(logdir):
    trainer = trained(logdir, "reduce_broadcast")
    for n in (1, 2, 3):
        batches = tf.data.Dataset.from_tensor_slices((EVAL_X[:n], EVAL_Y[:n])).batch(BATCH)
        with tf.device("/device:CPU:0"):
            logits = trainer.model(EVAL_X[:n], training=False)
        losses = experiment.default_loss()(EVAL_Y[:n], logits).numpy()
        bound = tolerance.mean_loss_bound(trainer.model, EVAL_X[:n], losses)
        assert abs(trainer.evaluate(batches)["loss"] - float(np.mean(losses))) <= bound


@pytest.mark.parametrize("aggregation", ["ps_cpu", "reduce_broadcast"])
def test_prediction_keeps_the_example_order(aggregation, logdir):
    trainer = trained(logdir, aggregation)
    expected, _, _ = single_device(trainer)
    from_array = trainer.predict(EVAL_X, batch_size=BATCH)
    from_dataset = trainer.predict(
        tf.data.Dataset.from_tensor_slices((EVAL_X, EVAL_Y)).batch(BATCH))
    for predicted in (from_array, from_dataset):
        assert predicted.shape == expected.shape
        tolerance.assert_within([predicted], [expected],
                                [tolerance.logit_bound(trainer.model, EVAL_X)])
    # Rows differ from one another, so a reordering would show.
    assert np.abs(np.diff(expected, axis=0)).max() > 1e-3


def test_each_batch_is_split_over_the_towers_in_use(logdir):
    trainer = trained(logdir, "ring")
    for n, towers_in_use in ((8, 4), (3, 3)):
        graph = trainer.inference._eval_batch.get_concrete_function(
            tf.constant(EVAL_X[:n]), tf.constant(EVAL_Y[:n]),
            trainer.inference._active_towers(n)).graph
        matmul_devices = {op.device for op in graph.get_operations() if op.type == "MatMul"}
        assert {d.rsplit(":", 1)[1] for d in matmul_devices} == {
            str(t) for t in range(towers_in_use)}
