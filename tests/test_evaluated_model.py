"""The model evaluated, exported and returned is the one the method produces.

DiLoCo (diloco:period=4, 2 simulated nodes, 6 steps: the last outer step closes step 4, so
the replicas are two inner steps past it) reports the eval of its outer parameters x and
exports x; local SGD (localsgd:period=4) the eval of the nodes' mean; and evaluating does
not change the training: the same run with --eval_every=2 ends with the same bits.

Tolerances (tests/tolerance.py): an eval by hand of the same weights on one device differs
from the towers' only in the order of float32 sums, within `mean_loss_bound`. x is the same
bits wherever it is read. The mean of two float32 copies is fl(a + b) * 0.5, which is the
correctly rounded (a + b) / 2 (halving is exact), so the by-hand mean in float64, rounded
once to float32, has the same bits. Two replicas two inner steps (lr 0.1, momentum) apart,
or a replica and x, give evals far outside that bound: the checks can fail.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import mgloop
from mgloop import data
from mgloop.runs import experiment
from tests import helpers
from tests import tolerance

STEPS = 6


def _run(logdir, aggregation, **settings):
    settings = dict(dict(eval_every=0), **settings)
    return mgloop.run(helpers.small_config(
        str(logdir), devices="cpu:2", nodes=2, aggregation=aggregation, train_steps=STEPS,
        steps_per_loop=2, checkpoint_every=0, **settings))


@pytest.fixture(scope="module")
def eval_set(tmp_path_factory):
    """The eval split the runs read (the config's dataset), whole, as numpy."""
    settings = helpers.small_config(str(tmp_path_factory.mktemp("eval_set"))).validated()
    dataset = data.load(settings.dataset, settings.seed, settings.data_dir,
                        settings.sequence_length)
    xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in dataset.eval_batches(64)])
    return np.concatenate(xs), np.concatenate(ys)


@pytest.fixture(scope="module")
def diloco(tmp_path_factory):
    folder = tmp_path_factory.mktemp("diloco")
    return _run(folder / "run", "diloco:period=4", export_dir=str(folder / "export")), folder


@pytest.fixture(scope="module")
def localsgd(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("localsgd") / "run", "localsgd:period=4",
                eval_every=STEPS, eval_each_node=True)  # the last eval in the history


def eval_by_hand(template, weights, eval_set):
    """(mean loss, per-example losses, the model) of `weights` on one device, all at once."""
    x, y = eval_set
    with tf.device("/device:CPU:0"):
        model = keras.models.clone_model(template)
        model.set_weights(weights)
        losses = experiment.default_loss()(y, model(x, training=False)).numpy()
    return float(np.mean(losses)), losses, model


def assert_eval_of(summary_loss, template, weights, eval_set):
    loss, losses, model = eval_by_hand(template, weights, eval_set)
    bound = tolerance.mean_loss_bound(model, eval_set[0], losses)
    assert abs(summary_loss - loss) <= bound, (summary_loss, loss, bound)
    return loss, bound


def assert_evaluates(result, produced, copies, eval_set, name):
    """The run's model is `produced` bit for bit, its eval is that model's by hand (within
    the bound), node 0's replica scores outside the bound, and the summary names it."""
    for returned, expected in zip(result.model.get_weights(), produced):
        np.testing.assert_array_equal(returned, expected)
    template = result.trainer.model
    _, bound = assert_eval_of(result["eval_loss"], template, produced, eval_set)
    replica, _, _ = eval_by_hand(template, copies[0], eval_set)
    assert abs(replica - result["eval_loss"]) > bound
    assert result["evaluated_model"] == name


def test_diloco_evaluates_its_outer_parameters(diloco, eval_set):
    result, _ = diloco
    trainer = result.trainer
    x = [v.numpy() for v in trainer.aggregation.inner._start[0]]
    copies = helpers.copy_weights(trainer)
    # mid-period: both replicas have moved away from x (and from each other)
    assert min(np.abs(a - b).max() for a, b in zip(copies[0], x)) > 1e-4
    assert max(np.abs(a - b).max() for a, b in zip(copies[0], copies[1])) > 1e-4
    # result.model is x; node 0's replica (what the export and result.model were) scores
    # outside the bound
    assert_evaluates(result, x, copies, eval_set, "outer parameters x")


def test_diloco_export_is_the_evaluated_model(diloco, eval_set):
    result, folder = diloco
    exported = keras.models.load_model(result["export_path"], compile=False)
    x = [v.numpy() for v in result.trainer.aggregation.inner._start[0]]
    for saved, expected in zip(exported.get_weights(), x):
        np.testing.assert_array_equal(saved, expected)
    with tf.device("/device:CPU:0"):
        losses = experiment.default_loss()(
            eval_set[1], exported(eval_set[0], training=False)).numpy()
    assert abs(float(np.mean(losses)) - result["eval_loss"]) <= tolerance.mean_loss_bound(
        exported, eval_set[0], losses)
    # predict uses the same model
    predicted = result.predict(eval_set[0][:19], batch_size=8)
    with tf.device("/device:CPU:0"):
        expected = exported(eval_set[0][:19], training=False).numpy()
    tolerance.assert_within([predicted], [expected],
                            [tolerance.logit_bound(exported, eval_set[0][:19])])


def test_localsgd_evaluates_the_nodes_mean(localsgd, eval_set):
    trainer = localsgd.trainer
    copies = helpers.copy_weights(trainer)
    assert max(np.abs(a - b).max() for a, b in zip(*copies)) > 1e-4  # mid-period
    mean = [((a.astype(np.float64) + b) / 2).astype(np.float32) for a, b in zip(*copies)]
    # the correctly rounded mean, bit for bit
    assert_evaluates(localsgd, mean, copies, eval_set, "mean of the 2 nodes' copies")


def test_each_nodes_copy_is_scored_beside_the_mean(localsgd, eval_set):
    """--eval_each_node: eval/node_n/loss is node n's own copy's eval, the spread max - min
    of them; the run's eval is still the mean's (the test above)."""
    record = [r for r in localsgd.history.records if "eval/node_0/loss" in r][-1]
    trainer = localsgd.trainer
    losses = []
    for n, weights in enumerate(helpers.copy_weights(trainer)):
        assert_eval_of(record[f"eval/node_{n}/loss"], trainer.model, weights, eval_set)
        losses.append(record[f"eval/node_{n}/loss"])
    assert record["eval/node_spread/loss"] == max(losses) - min(losses) > 0
    assert record["eval/loss"] == localsgd["eval_loss"]


def test_training_is_bit_equal_whatever_the_eval_interval(diloco, tmp_path):
    """The DiLoCo run above (no eval during training) and the same run evaluating every 2
    steps (3 evals of x between steps): every copy, its optimizer, x and m, the same bits."""
    result, _ = diloco
    evaluated = _run(tmp_path / "evals", "diloco:period=4", eval_every=2)
    assert [r["step"] for r in evaluated.history.records if "eval/loss" in r] == [2, 4, 6]

    def state(trainer):
        return [v.numpy() for copy in trainer.copies
                for v in copy.variables + list(copy.optimizer.variables)] + [
            v.numpy() for v in trainer.aggregation.state_variables]
    for a, b in zip(state(result.trainer), state(evaluated.trainer), strict=True):
        np.testing.assert_array_equal(a, b)
    assert evaluated["eval_loss"] == result["eval_loss"]
