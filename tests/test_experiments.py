"""The experiment flagfiles make valid Configs; the aggregation sweep fills an HParams logdir."""

import glob
import os
import subprocess
import sys

from absl import flags
import pytest

from mgloop import flags as mgloop_flags
from tests import dataset_files, tensorboard_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGFILES = sorted(glob.glob(os.path.join(ROOT, "experiments", "*.flags")))


def config_of(flagfile, *overrides):
    mgloop_flags.define_flags()
    try:
        flags.FLAGS(["train", f"--flagfile={flagfile}", *overrides])
        return mgloop_flags.config_from_flags()
    finally:
        flags.FLAGS.unparse_flags()


def test_the_experiments_have_flagfiles():
    names = {os.path.basename(path) for path in FLAGFILES}
    assert {"minigooglenet_cifar10.flags", "big_mlp.flags"} <= names


@pytest.mark.parametrize("flagfile", FLAGFILES, ids=os.path.basename)
def test_flagfile_makes_a_valid_config(flagfile, tmp_path):
    cifar = tmp_path / "cifar"
    dataset_files.write_cifar10(str(cifar))
    config = config_of(flagfile, f"--logdir={tmp_path / 'run'}")
    overrides = {"data_dir": str(cifar)} if config.dataset == "cifar10" else {}
    validated = config.__class__(**{**config.__dict__, **overrides}).validated()
    assert validated.global_batch_size % validated.num_towers == 0
    if config.model == "minigooglenet":  # the tutorial's recipe
        assert (config.dataset, config.lr_schedule, config.learning_rate, config.momentum,
                config.global_batch_size) == ("cifar10", "poly", 5e-3, 0.9, 256)
        assert config.train_steps == -(-70 * 50000 // 256)  # 70 epochs of 50,000 images


def test_cifar_flagfile_without_real_files_names_data_dir(tmp_path):
    config = config_of(os.path.join(ROOT, "experiments", "minigooglenet_cifar10.flags"),
                       f"--logdir={tmp_path / 'run'}", f"--data_dir={tmp_path / 'missing'}")
    with pytest.raises(Exception, match=r"^--data_dir=.*missing is not a directory"):
        config.validated()


def test_sweep_writes_one_hparams_session_per_run(tmp_path):
    parent = tmp_path / "sweep"
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "experiments", "sweep_aggregation.py"),
         f"--parent_logdir={parent}", "--modes=ps_cpu,ring", "--train_steps=4", "--",
         "--devices=cpu:2", "--global_batch_size=16", "--steps_per_loop=2",
         "--summary_every=2", "--log_every=0"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(parent))[-2:] == ["ps_cpu-pack0", "ring-pack0"]
    request = {"experimentName": "", "startIndex": 0, "sliceSize": 10,
               "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS"],
               "colParams": [{"hparam": "aggregation"},
                             {"metric": {"tag": "examples_per_sec", "group": "train"}}]}
    with tensorboard_server.serve(str(parent)) as board:
        sessions = board.wait_for(lambda s: len(s.get("sessionGroups", [])) == 2,
                                  "/data/plugin/hparams/session_groups", body=request)
    modes = {group["hparams"]["aggregation"] for group in sessions["sessionGroups"]}
    assert modes == {"ps_cpu", "ring"}
    for group in sessions["sessionGroups"]:
        values = {(m["name"]["group"], m["name"]["tag"]): m["value"]
                  for m in group["metricValues"]}
        assert values[("train", "examples_per_sec")] > 0  # the runs' own scalars
        assert 0 <= values[("eval", "accuracy")] <= 1
