"""--accumulation_steps=K: K micro-batches per update equal one step on a K-times larger batch.

Tolerance as in test_equivalence.py (the bound of tests/tolerance.py, computed along
the reference run): the towers and the micro-batches sum the same per-example
gradients in another order (and scale by 1/K once more: one of its R roundings),
so only float32 rounding separates them from the single device.
"""

import os

import keras
import numpy as np
import pytest

import mgloop
from mgloop.runs import export
from mgloop.data import epochs
from tests import helpers
from tests import tolerance

K = 4
MICRO_BATCH = helpers.GLOBAL_BATCH // K  # a quarter of the reference's batch
STEPS = 3


def exported_weights(export_dir):
    return keras.models.load_model(os.path.join(export_dir, export.EXPORT_FILENAME)).weights


def step_batches(steps, accumulation_steps=K, global_batch=MICRO_BATCH, start_step=0):
    stream = epochs.step_batches(helpers.DATASET, global_batch, accumulation_steps, seed=3,
                                          start_step=start_step).take(steps)
    return [(x.numpy(), y.numpy()) for x, y in stream]


def test_a_step_reads_k_consecutive_global_batches():
    """Step s holds global batches s*K .. s*K+K-1 of the stream, in order."""
    singles = helpers.DATASET.train_batches(MICRO_BATCH, 3).take(3 * K)
    singles = [(x.numpy(), y.numpy()) for x, y in singles]
    for s, (x, y) in enumerate(step_batches(3)):
        np.testing.assert_array_equal(x, np.concatenate([b[0] for b in singles[s * K:][:K]]))
        np.testing.assert_array_equal(y, np.concatenate([b[1] for b in singles[s * K:][:K]]))
    resumed = step_batches(1, start_step=2)[0]
    np.testing.assert_array_equal(resumed[0], step_batches(3)[2][0])


@pytest.mark.parametrize("mode,towers", [("ring", 4), ("ps_cpu", 2), ("colocate", 2)])
def test_k_quarter_batches_equal_one_step_on_the_full_batch(mode, towers, logdir):
    config = helpers.small_config(logdir, devices=f"cpu:{towers}", aggregation=mode,
                                  global_batch_size=MICRO_BATCH, accumulation_steps=K)
    batches = step_batches(STEPS)
    trainer, loss_sum = helpers.train_mgloop(config, batches)
    full = helpers.small_config(logdir)  # one device, global batch 16 = K x 4
    assert all(x.shape[0] == full.global_batch_size for x, _ in batches)
    expected = helpers.train_reference_bounded(full, batches)
    # The reported loss of a step is the mean over its micro-batches = the full batch's mean.
    for copy in helpers.copy_weights(trainer):
        tolerance.assert_matches_reference(copy, loss_sum, expected)
    for copy in trainer.copies:  # one update per step, not one per micro-batch
        assert int(copy.optimizer.iterations.numpy()) == STEPS
    assert int(trainer.global_step.numpy()) == STEPS


def test_updates_are_counted_per_step_and_the_loop_is_traced_once(logdir):
    config = helpers.small_config(logdir, devices="cpu:2", aggregation="ring",
                                  global_batch_size=MICRO_BATCH, accumulation_steps=K)
    trainer = helpers.build_trainer(config)
    batches = epochs.step_batches(helpers.DATASET, MICRO_BATCH, K, seed=3)
    result = helpers.fit(trainer, batches, 7, MICRO_BATCH * K, 3, summary_every=2)
    assert result.final_step == 7 and int(trainer.global_step.numpy()) == 7
    assert [int(c.optimizer.iterations.numpy()) for c in trainer.copies] == [7, 7]
    assert trainer.loop.compiled_loop.experimental_get_tracing_count() == 1
    assert 0.0 <= result.train["accuracy"] <= 1.0  # correct counts over K x B examples


def test_resume_with_accumulation_equals_straight_run(tmp_path):
    def run(name, **overrides):
        settings = dict(devices="cpu:2", aggregation="ring", global_batch_size=MICRO_BATCH,
                        accumulation_steps=K, train_steps=4, steps_per_loop=2,
                        checkpoint_every=0, export_dir=str(tmp_path / f"export_{name}"))
        settings.update(overrides)
        return mgloop.run(helpers.small_config(str(tmp_path / name), **settings))

    straight = run("straight")
    assert straight["final_step"] == 4
    assert run("resumed", train_steps=2)["final_step"] == 2
    resumed = run("resumed")
    assert (resumed["start_step"], resumed["final_step"]) == (2, 4)
    for a, b in zip(exported_weights(tmp_path / "export_resumed"),
                    exported_weights(tmp_path / "export_straight")):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_resume_with_other_accumulation_steps_is_refused(tmp_path):
    settings = dict(train_steps=2, accumulation_steps=2, checkpoint_every=0)
    mgloop.run(helpers.small_config(str(tmp_path / "run"), **settings))
    with pytest.raises(mgloop.ConfigError,
                       match=r"^--accumulation_steps=3 differs from 2 of the checkpoints"):
        helpers.small_config(str(tmp_path / "run"), accumulation_steps=3).validated()


@pytest.mark.parametrize("mode,scales", [("colocate", True), ("ring", False)])
def test_traffic_counts_every_micro_batch(mode, scales, logdir):
    """colocate moves parameters and gradients per micro-batch (K times a step); the tower
    loop reads parameters and exchanges gradients once per step."""
    def traffic(accumulation_steps):
        config = helpers.small_config(logdir, devices="cpu:2", aggregation=mode,
                                      global_batch_size=8, accumulation_steps=accumulation_steps)
        trainer, _ = helpers.train_mgloop(config, step_batches(1, accumulation_steps, 8))
        counted = trainer.aggregation.traffic
        return dict(counted.sent), dict(counted.messages_sent)  # bytes, messages (link model)

    once, twice = traffic(1), traffic(2)
    for counts_once, counts_twice in zip(once, twice):
        assert sum(counts_once.values()) > 0
        assert counts_twice == ({d: 2 * n for d, n in counts_once.items()} if scales
                                else counts_once)
