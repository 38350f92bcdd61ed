"""Checkpoint resume and the exported template model."""

import logging
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

import mgloop
from mgloop.runs import export
from tests import helpers
from tests import tolerance


def exported_weights(export_dir):
    model = keras.models.load_model(os.path.join(export_dir, export.EXPORT_FILENAME))
    return [w for w in model.get_weights()]


def run(tmp_path, name, **overrides):
    settings = dict(train_steps=10, steps_per_loop=3, checkpoint_every=0)
    settings.update(overrides)
    return mgloop.run(helpers.small_config(str(tmp_path / name), **settings))


def test_resume_equals_straight_run(tmp_path):
    run(tmp_path, "straight", export_dir=str(tmp_path / "export_straight"))
    first = run(tmp_path, "resumed", train_steps=5)
    assert (first["start_step"], first["final_step"]) == (0, 5)
    second = run(tmp_path, "resumed", export_dir=str(tmp_path / "export_resumed"))
    assert (second["start_step"], second["final_step"]) == (5, 10)
    for a, b in zip(exported_weights(tmp_path / "export_resumed"),
                    exported_weights(tmp_path / "export_straight")):
        np.testing.assert_array_equal(a, b)


def test_resume_with_another_layout_and_tower_count(tmp_path):
    """A checkpoint holds copy 0 only: 5 steps of ps_cpu on 1 device, then 5 of ring on 4."""
    run(tmp_path, "straight", export_dir=str(tmp_path / "export_straight"))
    run(tmp_path, "mixed", train_steps=5)
    summary = run(tmp_path, "mixed", devices="cpu:4", aggregation="ring",
                  export_dir=str(tmp_path / "export_mixed"))
    assert summary["start_step"] == 5 and summary["num_towers"] == 4
    # both lie within the float32 bound of the one-device run (tests/tolerance.py): within 2x
    bound = helpers.bound_of_run(helpers.small_config(str(tmp_path / "bound")), 10)
    tolerance.assert_within(exported_weights(tmp_path / "export_mixed"),
                            exported_weights(tmp_path / "export_straight"),
                            [2 * t for t in bound.weights()])


@pytest.fixture(scope="module")
def resumable(tmp_path_factory):
    """A logdir with the checkpoint of a 2-step run (the small config)."""
    folder = tmp_path_factory.mktemp("resumable")
    run(folder, "run", train_steps=2)
    return str(folder / "run")


@pytest.mark.parametrize("train_steps", [2, 1])
def test_finished_run_says_so_and_leaves_its_summary_alone(resumable, train_steps, caplog):
    """At or below the checkpoint's step nothing trains, and summary.json (with its
    metrics) is not overwritten by an empty run's nulls."""
    path = os.path.join(resumable, "summary.json")
    before = open(path, "rb").read()
    with caplog.at_level(logging.INFO, logger="absl"):
        again = mgloop.run(helpers.small_config(resumable, train_steps=train_steps))
    assert open(path, "rb").read() == before
    assert again["final_step"] == 2 and again["final_train_loss"] is not None
    assert re.search(rf"the run in --logdir=.*run is finished: its checkpoint is at step 2 "
                     rf"and --train_steps={train_steps}, so nothing is trained", caplog.text)


def test_a_stopped_runs_summary_is_not_an_end(tmp_path):
    """A summary.json of a run stopped by a signal, with a checkpoint at --train_steps from
    a later run that failed before its end (an elastic round lost in its final eval):
    resuming trains nothing, evaluates and writes the end's summary (it had returned the
    stale summary, so mgloop.train exited 143 at every restart)."""
    run(tmp_path, "run", train_steps=2)
    path = tmp_path / "run" / "summary.json"
    path.write_text('{"final_step": 1, "preempted": {"signal": "SIGTERM", "step": 1}}')
    again = run(tmp_path, "run", train_steps=2)
    assert not again.get("preempted") and again["final_step"] == 2, again
    assert again["eval_accuracy"] is not None
    assert '"preempted"' not in path.read_text()


@pytest.mark.parametrize("setting, value, previous", [
    ("seed", 4, 3), ("global_batch_size", 32, 16), ("drop_remainder", False, True)])
def test_resume_that_changes_the_data_is_refused_before_building(
        resumable, monkeypatch, setting, value, previous):
    from mgloop.runs import assemble

    def refuse(*args, **kwargs):
        raise AssertionError("variables were built before validation finished")
    monkeypatch.setattr(assemble, "build", refuse)
    config = helpers.small_config(resumable, **{setting: value})
    with pytest.raises(mgloop.ConfigError, match=rf"^--{setting}={value!r} differs from "
                       rf"{previous!r} of the checkpoints in --logdir=.*--{setting}={previous} "
                       r"or use a fresh --logdir$"):
        config.validated()


def test_resume_with_other_settings_logs_them_in_one_line(resumable, caplog):
    with caplog.at_level(logging.INFO, logger="absl"):
        helpers.small_config(resumable, learning_rate=0.05, lr_schedule="cosine",
                             devices="cpu:2", train_steps=5).validated()
    lines = [r.getMessage() for r in caplog.records if "differ from their run" in r.getMessage()]
    assert len(lines) == 1
    for change in ("--learning_rate=0.05 (was 0.1)", "--lr_schedule=cosine (was constant)",
                   "--devices=cpu:2 (was cpu:1)", "--train_steps=5 (was 2)"):
        assert change in lines[0]
    assert "--seed" not in lines[0] and "--model" not in lines[0]


def test_export_loads_with_plain_keras_in_a_fresh_process(tmp_path):
    config = helpers.small_config(str(tmp_path / "run"), devices="cpu:2", aggregation="ring",
                                  model="cnn")
    trainer, _ = helpers.train_mgloop(config, helpers.batches(3))
    path = export.export_model(trainer.model, str(tmp_path / "export"))
    inputs = helpers.DATASET.eval_x[:10]
    np.save(tmp_path / "inputs.npy", inputs)
    expected = trainer.model.predict(inputs, verbose=0)
    script = (
        "import sys, numpy as np, keras\n"
        "model = keras.models.load_model(sys.argv[1])\n"
        "np.save(sys.argv[3], model.predict(np.load(sys.argv[2]), verbose=0))\n"
        "assert not any(m.startswith(('mgloop', 'third_party')) for m in sys.modules)\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    subprocess.run([sys.executable, "-c", script, path, str(tmp_path / "inputs.npy"),
                    str(tmp_path / "out.npy")], check=True, cwd=tmp_path, env=env,
                   capture_output=True, timeout=300)
    # Another process may run other kernels or block sums otherwise (its own thread pool,
    # oneDNN's choice): within tolerance.logit_bound of the in-process outputs.
    tolerance.assert_within([np.load(tmp_path / "out.npy")], [expected],
                            [tolerance.logit_bound(trainer.model, inputs)])
    assert sorted(os.listdir(tmp_path / "export")) == ["model.keras"]  # no temp file left


def test_resume_with_another_model_is_refused_before_building(tmp_path, monkeypatch):
    run(tmp_path, "mlp_run", train_steps=2)
    from mgloop.runs import assemble

    def refuse(*args, **kwargs):
        raise AssertionError("variables were built before validation finished")
    monkeypatch.setattr(assemble, "build", refuse)
    with pytest.raises(mgloop.ConfigError, match=r"^--model='cnn' differs from 'mlp' of the "
                                                 r"checkpoints in --logdir=.*--model=mlp"):
        run(tmp_path, "mlp_run", model="cnn")


def test_checkpoint_that_does_not_match_the_model_is_a_clear_error(tmp_path):
    """Without config.json to compare, the restore itself refuses (CLI: one line, exit 2)."""
    run(tmp_path, "mlp_run", train_steps=2)
    os.remove(tmp_path / "mlp_run" / "config.json")
    result = subprocess.run(
        [sys.executable, "-m", "mgloop.train", f"--logdir={tmp_path / 'mlp_run'}", "--model=cnn",
         "--devices=cpu:1", "--global_batch_size=16", "--train_steps=4"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("mgloop.train:")]
    assert len(errors) == 1
    assert re.match(r"mgloop.train: error: --logdir=.*mlp_run: checkpoint .*ckpt-2 is intact "
                    r"but does not match this model and optimizer .*use a fresh --logdir$",
                    errors[0])
