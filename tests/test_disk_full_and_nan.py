"""A full disk and a NaN loss: one line naming the path or the steps; no checkpoint holds NaN."""

import errno
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import mgloop
from mgloop.runs import checkpoint, checkpoint_files, failures
from tests import helpers

NO_SPACE = ("{{function_node __wrapped__SaveV2_dtypes_22_device_/job:localhost/replica:0/task:0/"
            "device:CPU:0}} %s/ckpt-%d_temp/part-00000-of-00001.data-00000-of-00001.tempstate1; "
            "No space left on device [Op:SaveV2]")  # TensorFlow's text on a full tmpfs


def test_disk_full_during_a_save_names_the_path_and_keeps_the_last_checkpoint(
        tmp_path, monkeypatch):
    logdir = str(tmp_path / "run")
    folder = os.path.join(logdir, "checkpoints")
    save = tf.train.CheckpointManager.save

    def fill_the_disk_at_step_4(manager, checkpoint_number=None, **kwargs):
        if checkpoint_number < 4:
            return save(manager, checkpoint_number=checkpoint_number, **kwargs)
        os.makedirs(os.path.join(folder, f"ckpt-{checkpoint_number}_temp"))
        raise tf.errors.ResourceExhaustedError(None, None, NO_SPACE % (folder,
                                                                       checkpoint_number))
    monkeypatch.setattr(tf.train.CheckpointManager, "save", fill_the_disk_at_step_4)
    config = helpers.small_config(logdir, train_steps=6, steps_per_loop=2, checkpoint_every=2)
    with pytest.raises(failures.DiskFull) as error:
        mgloop.run(config)
    message = str(error.value)
    assert "\n" not in message
    assert re.match(rf"^no space left on the device of {re.escape(folder)}/ckpt-4_temp/part-.*"
                    rf" while saving the checkpoint of step 4; the last complete checkpoint "
                    rf"\({re.escape(folder)}/ckpt-2\) is kept: free space, then rerun", message)
    assert checkpoint_files.checkpoint_steps(folder) == [2]
    assert not os.path.exists(os.path.join(folder, "ckpt-4_temp"))  # its space is given back


def test_cli_says_disk_full_in_one_line(tmp_path):
    """A summary write on a full disk: exit 1 and one line naming the file."""
    logdir = tmp_path / "run"
    script = (
        "import errno, sys\n"
        "from absl import app\n"
        "from mgloop import train\n"
        "from mgloop.observe import summaries\n"
        "def full(path, payload):\n"
        "    raise OSError(errno.ENOSPC, 'No space left on device', path)\n"
        "summaries.write_json_atomically = full\n"
        "app.run(train.main)\n")
    result = subprocess.run(
        [sys.executable, "-c", script, f"--logdir={logdir}", "--devices=cpu:1",
         "--global_batch_size=16", "--train_steps=2", "--steps_per_loop=2"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("mgloop.train:")]
    assert errors == [f"mgloop.train: error: no space left on the device of {logdir}/config.json;"
                      " the last complete checkpoint in --logdir is kept: free space, then "
                      "rerun the same command to resume"]
    assert failures.disk_full_path(OSError(errno.ENOSPC, "x", "/a")) == "/a"


def checkpoint_values_are_finite(folder):
    for step in checkpoint_files.checkpoint_steps(folder):
        reader = tf.train.load_checkpoint(os.path.join(folder, f"ckpt-{step}"))
        for key, dtype in reader.get_variable_to_dtype_map().items():
            if dtype.is_floating and not np.isfinite(reader.get_tensor(key)).all():
                return False
    return True


def test_nan_loss_names_the_steps_and_the_last_finite_checkpoint(tmp_path):
    """A huge learning rate: the run stops in one line; every checkpoint is finite."""
    logdir = str(tmp_path / "run")
    folder = os.path.join(logdir, "checkpoints")
    config = helpers.small_config(logdir, learning_rate=1e6, train_steps=40, steps_per_loop=1,
                                  checkpoint_every=1, keep_checkpoints=100)
    with pytest.raises(failures.NonFinite) as error:
        mgloop.run(config)
    message = str(error.value)
    assert "\n" not in message
    steps = checkpoint_files.checkpoint_steps(folder)
    assert steps and checkpoint_values_are_finite(folder)
    last = os.path.join(folder, f"ckpt-{steps[0]}")
    assert re.match(rf"^(the training loss is (nan|inf) in steps {steps[0] + 1}\.\.{steps[0] + 1}"
                    rf"|.* holds NaN or inf at step {steps[0] + 1}), so (no|its) checkpoint is "
                    rf"(written for them|not written); .*rerun with the same --logdir and a lower "
                    rf"--learning_rate to resume from (it|the last checkpoint \({re.escape(last)}"
                    rf"\))$", message), message


def test_a_checkpoint_of_non_finite_variables_is_refused(tmp_path):
    trainer = helpers.build_trainer(helpers.small_config(str(tmp_path / "run")))
    folder = str(tmp_path / "checkpoints")
    saver = checkpoint.Checkpointer(folder, trainer.model, trainer.copies[0].optimizer,
                                    trainer.global_step, keep=3)
    saver.save(0)
    kernel = trainer.model.trainable_variables[0]
    kernel.assign(tf.fill(kernel.shape, np.nan))
    with pytest.raises(failures.NonFinite, match=rf"^{re.escape(kernel.path)} holds NaN or inf "
                       r"at step 1, so its checkpoint is not written; the last checkpoint \(.*"
                       r"ckpt-0\) is finite"):
        saver.save(1)
    assert checkpoint_files.checkpoint_steps(folder) == [0]


def test_a_non_finite_method_state_is_named_in_the_refusal(tmp_path):
    """A method's state is a plain tf.Variable (no Keras `path`): the refusal names it
    by its TensorFlow name instead of failing on the name (issue 23's soak)."""
    trainer = helpers.build_trainer(helpers.small_config(str(tmp_path / "run"), devices="cpu:2",
                                                         aggregation="topk:ratio=0.25"))
    aggregation = trainer.replicas.aggregation
    saver = checkpoint.Checkpointer(str(tmp_path / "checkpoints"), trainer.model,
                                    trainer.copies[0].optimizer, trainer.global_step, keep=3,
                                    aggregation=aggregation)
    residual = next(v for v in aggregation.state_variables if v.dtype.is_floating)
    residual.assign(tf.fill(residual.shape, np.inf))
    with pytest.raises(failures.NonFinite, match=rf"^{re.escape(residual.name)} holds NaN or "
                       r"inf at step 1, so its checkpoint is not written"):
        saver.save(1)
