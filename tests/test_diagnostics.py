"""--diagnostics: per-tower statistics in the step, replica divergence, and a lost logdir."""

import glob
import os
import shutil
import tempfile

import numpy as np
import pytest
import tensorflow as tf

import mgloop
from mgloop.observe import diagnostics, summaries
from mgloop.runs import experiment, monitor
from tests import helpers
from tests import tolerance


def tower_gradients(trainer, x, y):
    """Each tower's gradient of its shard's mean loss, on the template's current weights,
    and the float32 bounds (tests/tolerance.py) on the gradient (elementwise) and the loss."""
    grads, losses, bounds = [], [], []
    for x_t, y_t in zip(np.split(x, trainer.num_towers), np.split(y, trainer.num_towers)):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(experiment.default_loss()(y_t, trainer.model(x_t)))
        grads.append(np.concatenate([g.numpy().ravel() for g in
                                     tape.gradient(loss, trainer.model.trainable_variables)]))
        losses.append(float(loss))
        bounds.append(tolerance.gradient_bound(trainer.model, experiment.default_loss(),
                                               x_t, y_t))
    return grads, losses, bounds


@pytest.mark.parametrize("aggregation", ["ring", "ps_cpu"])
def test_step_statistics_equal_numpy_on_the_towers_gradients(logdir, aggregation):
    trainer = helpers.build_trainer(helpers.small_config(logdir, devices="cpu:4",
                                                         aggregation=aggregation,
                                                         diagnostics=True))
    (x0, y0), (x, y) = helpers.batches(2)
    unsampled = trainer.train_loop(iter(tf.data.Dataset.from_tensors((x0, y0))), 1,
                                   sample_stats=False)
    assert unsampled.stats == {}  # not asked: not computed
    grads, losses, bounds = tower_gradients(trainer, x, y)  # the weights after step 1
    result = trainer.train_loop(iter(tf.data.Dataset.from_tensors((x, y))), 1)
    # Bounds: g_t within dg_t elementwise (tolerance.gradient_bound), so a norm within
    # e_t = ||dg_t|| (+ its own sum of squares: gamma(P) ||g_t||, P parameters); a cosine
    # moves by at most 2 (e_i/||g_i|| + e_j/||g_j||); the ratio ||mean g|| / mean ||g||
    # by mean(e)/||mean g|| + mean(e)/mean||g|| of itself.
    norms = [np.linalg.norm(g) for g in grads]
    errors = [np.linalg.norm(dg) + tolerance.gamma(g.size) * n
              for (dg, _), g, n in zip(bounds, grads, norms)]
    for t in range(4):
        assert abs(result.stats[f"tower_{t}/loss"] - losses[t]) <= bounds[t][1]
        assert abs(result.stats[f"tower_{t}/grad_norm"] - norms[t]) <= errors[t]
    pairs = [(i, j) for i in range(4) for j in range(4) if i < j]
    cosines = [grads[i] @ grads[j] / (norms[i] * norms[j]) for i, j in pairs]
    cosine_bound = np.mean([2 * (errors[i] / norms[i] + errors[j] / norms[j]) for i, j in pairs])
    assert abs(result.stats["grad/cosine_mean"] - np.mean(cosines)) <= cosine_bound
    mean_norm = np.linalg.norm(np.mean(grads, axis=0))
    ratio = mean_norm / np.mean(norms)
    ratio_bound = ratio * (np.mean(errors) / mean_norm + np.mean(errors) / np.mean(norms))
    assert abs(result.stats["grad/norm_ratio"] - ratio) <= ratio_bound
    assert 0 < ratio < 1 and max(cosines) < 0.99  # different shards: not all aligned
    # The same two steps in one loop: the sample is the last step's, not the first's.
    # Its statistics are taken at the twin's weights after step 1, which lie within
    # step 1's float32 bound of this trainer's; by tests/tolerance.py's premise 3 that
    # moves step 2's gradient and loss by at most FEEDBACK - 1 times their own bound, so
    # the twin is within FEEDBACK times the bounds above of the numpy values, and
    # within 1 + FEEDBACK times them of this trainer's statistics.
    twin = helpers.build_trainer(helpers.small_config(logdir, devices="cpu:4",
                                                      aggregation=aggregation, diagnostics=True))
    both = twin.train_loop(iter(tf.data.Dataset.from_tensor_slices(
        (np.stack([x0, x]), np.stack([y0, y])))), 2)
    bounds_by_name = {"grad/cosine_mean": cosine_bound, "grad/norm_ratio": ratio_bound}
    for t in range(4):
        bounds_by_name.update({f"tower_{t}/loss": bounds[t][1],
                               f"tower_{t}/grad_norm": errors[t]})
    assert set(both.stats) == set(bounds_by_name) | {"replica/divergence"}
    for name, bound in bounds_by_name.items():
        assert abs(both.stats[name] - result.stats[name]) <= (1 + tolerance.FEEDBACK) * bound
    # every copy applies the same reduced gradient bits with the same elementwise update
    # ops on the same host: copies stay bit-identical on any CPU
    assert both.stats["replica/divergence"] == result.stats["replica/divergence"] == 0.0


def test_identical_shards_agree_perfectly(logdir):
    trainer = helpers.build_trainer(helpers.small_config(logdir, devices="cpu:4",
                                                         aggregation="ring", diagnostics=True))
    steps = [(np.concatenate([x[:4]] * 4), np.concatenate([y[:4]] * 4))  # one shard, 4 times
             for x, y in helpers.batches(3)]
    result = trainer.train_loop(iter(tf.data.Dataset.from_tensor_slices(
        (np.stack([x for x, _ in steps]), np.stack([y for _, y in steps])))), 3)
    means = result.stats  # of the last step of the 3
    assert len({means[f"tower_{t}/grad_norm"] for t in range(4)}) == 1
    # The towers' gradients g are bit-identical (same shard, same ops), so exactly
    # cosine = ratio = 1; in float32 (diagnostics.gradient_stats): each Gram entry is a
    # dot product of P terms, within gamma(P) of |g|^2; G_ij / (n_i n_j) adds the two
    # norms' sqrt (gamma(P)/2 + u each), the inverses, the products and the 4-term sums
    # of the matmuls: within 2 gamma(P) + 14 u <= 2 gamma(P + 12) = e of 1. cosine_mean
    # = (sum of the 16 - 4) / 12: within 16 e / 12 + u of 1. The ratio
    # sqrt(sum G) / sum n_t: within gamma(P) + gamma(16) / 2 + gamma(4) + 3 u <= e of 1.
    # A cosine or ratio off by a shard's gradient left out, or a missing 1/T, is off by O(1).
    parameters = sum(int(np.prod(v.shape)) for v in trainer.model.trainable_variables)
    bound = 2 * tolerance.gamma(parameters + 12)
    assert abs(means["grad/cosine_mean"] - 1.0) <= bound * 16 / 12 + tolerance.U
    assert abs(means["grad/norm_ratio"] - 1.0) <= bound


@pytest.mark.parametrize("staging", ["none", "device"])
def test_the_sampled_last_step_trains_as_the_others(logdir, staging):
    """Statistics on: the last step of a loop runs apart; steps, losses and weights are
    those of a run without them, including a loop cut short by the end of the input."""
    stream = helpers.batches(5)
    data = tf.data.Dataset.from_tensor_slices(tuple(np.stack(a) for a in zip(*stream)))
    runs = []
    for on in (False, True):
        trainer = helpers.build_trainer(helpers.small_config(
            logdir, devices="cpu:2", aggregation="ring", diagnostics=on, staging=staging))
        iterator = iter(trainer.staging.pipeline(data))
        first, second = trainer.train_loop(iterator, 3), trainer.train_loop(iterator, 3)
        runs.append((first, second, [v.numpy() for v in trainer.copies[0].trainable]))
        assert (first.steps, second.steps) == (3, 2)  # the input ends in the second loop
        assert bool(first.stats) == on and second.stats == {}  # its last step never came
    (off_1, off_2, off_weights), (on_1, on_2, on_weights) = runs
    # both within the float32 bound of the one-device run (tests/tolerance.py): within 2x
    # (a loop's loss sum within the bound of all 5 steps' losses)
    _, _, bound = helpers.train_reference_bounded(helpers.small_config(logdir), stream)
    assert abs(on_1.loss_sum - off_1.loss_sum) <= 2 * bound.loss_sum
    assert abs(on_2.loss_sum - off_2.loss_sum) <= 2 * bound.loss_sum
    tolerance.assert_within(on_weights, off_weights, [2 * t for t in bound.weights()])


def test_diagnostics_off_trace_nothing(logdir):
    trainer = helpers.build_trainer(helpers.small_config(logdir, devices="cpu:2"))
    result = trainer.train_loop(iter(tf.data.Dataset.from_tensor_slices(
        tuple(np.stack(a) for a in zip(*helpers.batches(2))))), 2)
    assert result.stats == {} and trainer.stat_names == []


@pytest.mark.parametrize("aggregation,diverges", [("ring", False), ("independent", True)])
def test_replica_divergence(logdir, aggregation, diverges):
    config = helpers.small_config(logdir, devices="cpu:4", aggregation=aggregation,
                                  diagnostics=True)
    trainer = helpers.build_trainer(config)
    steps = helpers.batches(3)
    result = trainer.train_loop(iter(tf.data.Dataset.from_tensor_slices(
        tuple(np.stack(a) for a in zip(*steps)))), 3)
    divergence = result.stats["replica/divergence"]  # after the loop's last update
    largest = max(np.max(np.abs(mine.numpy() - first.numpy())) for copy in trainer.copies[1:]
                  for mine, first in zip(copy.trainable, trainer.copies[0].trainable))
    # max |v_c - v_0|: one IEEE float32 subtraction (correctly rounded on any CPU, the
    # same in numpy), abs and max are exact: equal bit for bit
    assert divergence == largest
    assert float(diagnostics.replica_divergence(trainer.copies)) == divergence  # eager too
    if diverges:
        assert divergence > 1e-4
    else:
        assert divergence == 0.0


def test_lost_logdir_is_one_clear_error_and_the_checkpoint_is_kept(tmp_path, monkeypatch):
    logdir = str(tmp_path / "run")
    original = summaries.ScalarWriter.scalars

    def remove_logdir_at_step_10(self, step, values):
        if step == 10 and os.path.isdir(logdir):
            shutil.rmtree(logdir)
        original(self, step, values)
    monkeypatch.setattr(summaries.ScalarWriter, "scalars", remove_logdir_at_step_10)
    config = helpers.small_config(logdir, devices="cpu:2", train_steps=20, steps_per_loop=5,
                                  summary_every=5, checkpoint_every=5)
    with pytest.raises(monitor.LogdirLost) as raised:
        mgloop.run(config, train_data=helpers.DATASET)
    message = str(raised.value)
    assert "\n" not in message and f"--logdir={logdir} disappeared" in message
    rescue = message.split("resume with --logdir=")[1]
    assert os.path.dirname(rescue) == str(tmp_path)
    latest = tf.train.latest_checkpoint(os.path.join(rescue, "checkpoints"))
    step = int(tf.train.load_variable(latest, "step/.ATTRIBUTES/VARIABLE_VALUE"))
    assert step >= 10


def scalar_events(folder):
    """{tag: [(step, value)]} of the event files in `folder`."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith("events"):
            for event in tf.compat.v1.train.summary_iterator(os.path.join(folder, name)):
                for value in event.summary.value:
                    out.setdefault(value.tag, []).append(
                        (event.step, float(tf.make_ndarray(value.tensor))))
    return out


def test_a_compiled_histogram_write_records_what_an_eager_one_does(tmp_path):
    """The first write of a set of histograms is eager, the later ones one compiled call
    (traced once): each step's histogram (bucket edges and counts) is the eager one's."""
    writer = summaries.ScalarWriter(str(tmp_path), "train")
    rng = np.random.default_rng(0)
    values = {"weights/kernel": rng.standard_normal((6, 4)).astype(np.float32),
              "weights/bias": rng.standard_normal(4).astype(np.float16),
              "gradients/kernel": np.zeros((6, 4), np.float32)}
    for step in (1, 2, 3):
        writer.histograms(step, values)
    writer.close()
    compiled = list(writer._compiled.values())
    assert len(compiled) == 1 and compiled[0].experimental_get_tracing_count() == 1
    seen = {}
    for name in os.listdir(tmp_path / "train"):
        for event in tf.compat.v1.train.summary_iterator(str(tmp_path / "train" / name)):
            for value in event.summary.value:
                seen.setdefault(value.tag, {})[event.step] = tf.make_ndarray(value.tensor)
    assert set(seen) == set(values)
    for tag, by_step in seen.items():
        assert sorted(by_step) == [1, 2, 3]
        assert by_step[1].shape[1] == 3 and by_step[1][:, 2].sum() == values[tag].size
        for step in (2, 3):
            np.testing.assert_array_equal(by_step[step], by_step[1], err_msg=tag)


def test_profile_eval_and_loss_scale_in_a_short_run(logdir, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where breakdown traces go
    config = helpers.small_config(logdir, devices="cpu:2", aggregation="ring", train_steps=6,
                                  steps_per_loop=6, summary_every=3, eval_every=2,
                                  profile_steps="2,4", mixed_precision="mixed_float16",
                                  breakdown_every=2)
    mgloop.run(config, train_data=helpers.DATASET, command_line=["train", "--flag"])
    traces = [os.path.join(root, f) for root, _, files in
              os.walk(os.path.join(logdir, "plugins", "profile")) for f in files]
    assert any(t.endswith(".xplane.pb") and os.path.getsize(t) > 0 for t in traces)
    assert [step for step, _ in scalar_events(os.path.join(logdir, "eval"))["accuracy"]] == [
        2, 4, 6]
    train = scalar_events(os.path.join(logdir, "train"))
    assert [value for _, value in train["loss_scale"]] == [2.0 ** 15] * 2  # no overflow
    assert "replica/divergence" not in train and "tower_0/loss" not in train  # off by default
    # Steps 2 and 6 profiled alone for the breakdown; step 4 not: --profile_steps' trace runs.
    assert [step for step, _ in train["breakdown/compute"]] == [2, 6]
    assert not glob.glob(str(tmp_path / "mgloop-breakdown-*"))  # the traces are removed
