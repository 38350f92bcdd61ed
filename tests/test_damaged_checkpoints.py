"""Damaged checkpoints: told apart from another model, named, skipped for the newest intact one.

One short run writes checkpoints of steps 2, 4 and 6; each test damages a copy of its
checkpoint folder the way a crash, a full disk or a bad disk would, and restores it into a
trainer of the same model.
"""

import logging
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

import mgloop
from mgloop.runs import checkpoint, checkpoint_files
from tests import helpers

SETTINGS = dict(train_steps=6, steps_per_loop=2, checkpoint_every=2, keep_checkpoints=3)
DATA = "ckpt-6.data-00000-of-00001"
INDEX = "ckpt-6.index"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The logdir of a run with checkpoints of steps 2, 4, 6."""
    logdir = str(tmp_path_factory.mktemp("written") / "run")
    mgloop.run(helpers.small_config(logdir, **SETTINGS))
    assert checkpoint_files.checkpoint_steps(os.path.join(logdir, "checkpoints")) == [6, 4, 2]
    return logdir


@pytest.fixture(scope="module")
def trainer():
    return helpers.build_trainer(helpers.small_config(None, **SETTINGS))


def copy_of(written, tmp_path):
    folder = str(tmp_path / "checkpoints")
    shutil.copytree(os.path.join(written, "checkpoints"), folder)
    return folder


def checkpointer(folder, trainer):
    return checkpoint.Checkpointer(folder, trainer.model, trainer.copies[0].optimizer,
                                   trainer.global_step, keep=3)


def truncate(path, size):
    with open(path, "r+b") as handle:
        handle.truncate(size)


def flip_bytes(path, every=997):
    data = bytearray(open(path, "rb").read())
    for i in range(every // 2, len(data), every):
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))


DAMAGE = {  # name: (how, the file the warning must name)
    "truncated data": (lambda d: truncate(os.path.join(d, DATA), 1000), DATA),
    "empty data": (lambda d: truncate(os.path.join(d, DATA), 0), DATA),
    "flipped bytes in the data": (lambda d: flip_bytes(os.path.join(d, DATA)), DATA),
    "random data": (lambda d: open(os.path.join(d, DATA), "wb").write(
        np.random.default_rng(0).bytes(os.path.getsize(os.path.join(d, DATA)))), DATA),
    "missing data": (lambda d: os.remove(os.path.join(d, DATA)), DATA),
    "bad index": (lambda d: flip_bytes(os.path.join(d, INDEX), every=101), INDEX),
    "empty index": (lambda d: truncate(os.path.join(d, INDEX), 0), INDEX),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one(
        case, written, trainer, tmp_path, caplog):
    folder = copy_of(written, tmp_path)
    damage, named = DAMAGE[case]
    damage(folder)
    with caplog.at_level(logging.WARNING, logger="absl"):
        restored = checkpointer(folder, trainer).restore_latest()
    assert restored == os.path.join(folder, "ckpt-4")
    assert int(trainer.global_step.numpy()) == 4
    lines = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(lines) == 1 and f"{named}: " in lines[0] and "resuming from ckpt-4" in lines[0]
    assert "does not match this model" not in caplog.text
    # the damaged files are set aside; the state file now names the checkpoint restored
    assert checkpoint_files.checkpoint_steps(folder) == [4, 2]
    assert any(n.endswith(checkpoint_files.DAMAGED_SUFFIX) for n in os.listdir(folder))
    assert tf.train.get_checkpoint_state(folder).model_checkpoint_path.endswith("ckpt-4")


STATE = {
    "garbage state file": lambda path: open(path, "w").write("garbage!!\n"),
    "empty state file": lambda path: open(path, "w").close(),
    "binary state file": lambda path: open(path, "wb").write(b"\xff\xfe\x00\x01"),
    "missing state file": os.remove,
}


@pytest.mark.parametrize("case", sorted(STATE))
def test_damaged_state_file_resumes_from_the_newest_checkpoint(case, written, trainer, tmp_path):
    folder = copy_of(written, tmp_path)
    STATE[case](os.path.join(folder, checkpoint_files.STATE_FILENAME))
    assert checkpointer(folder, trainer).restore_latest() == os.path.join(folder, "ckpt-6")
    assert int(trainer.global_step.numpy()) == 6
    state = tf.train.get_checkpoint_state(folder)  # rebuilt, so that old ones are deleted
    assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == [
        "ckpt-2", "ckpt-4", "ckpt-6"]


def test_leftovers_of_an_interrupted_save_are_removed(written, trainer, tmp_path):
    folder = copy_of(written, tmp_path)
    os.makedirs(os.path.join(folder, "ckpt-8_temp"))
    open(os.path.join(folder, "ckpt-8_temp", "part-00000-of-00001.index"), "w").close()
    open(os.path.join(folder, "checkpoint.tmp0123abcd"), "w").close()
    open(os.path.join(folder, "ckpt-8.data-00000-of-00001"), "w").close()  # merged, no index
    assert checkpointer(folder, trainer).restore_latest() == os.path.join(folder, "ckpt-6")
    assert sorted(os.listdir(folder)) == sorted(os.listdir(os.path.join(written, "checkpoints")))


def test_every_checkpoint_damaged_is_refused_naming_them(written, trainer, tmp_path):
    folder = copy_of(written, tmp_path)
    for step in (2, 4, 6):
        truncate(os.path.join(folder, f"ckpt-{step}.data-00000-of-00001"), 10)
    with pytest.raises(mgloop.ConfigError, match=r"^--logdir=.*: no checkpoint in .* is intact "
                       r"\(ckpt-6.data-00000-of-00001: .*; ckpt-4.data.*; ckpt-2.data.*\); "
                       r".*move the checkpoints folder away to start again from step 0$"):
        checkpointer(folder, trainer).restore_latest()
    assert checkpoint_files.checkpoint_steps(folder) == [6, 4, 2]  # nothing renamed: user's choice


def test_garbage_state_file_never_restarts_the_run_from_step_0(written, tmp_path):
    """End to end: the run resumes at step 6 instead of training (and saving) from 0."""
    logdir = str(tmp_path / "run")
    shutil.copytree(written, logdir)
    open(os.path.join(logdir, "checkpoints", checkpoint_files.STATE_FILENAME), "w").write("garbage")
    summary = mgloop.run(helpers.small_config(logdir, **dict(SETTINGS, train_steps=8)))
    assert (summary["start_step"], summary["final_step"]) == (6, 8)
