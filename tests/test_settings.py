"""Settings: each module checks its own, the run folders (run_dir.py), and the HParams record
holds every setting that can change a result."""

import dataclasses
import json
import logging
import os

import pytest
import tensorflow as tf
from tensorboard.plugins.hparams import plugin_data_pb2

import mgloop
from mgloop.runs import config as config_lib
from mgloop import data, settings
from mgloop.data import checks as data_checks
from mgloop.models import checks as model_checks
from mgloop.runs import loop_checks, monitor, run_dir
from mgloop.observe import checks as observe_checks
from mgloop.training import checks as optim_checks
from mgloop.step import checks as step_checks
from mgloop.runs.config import Config
from tests import helpers


def step_check(config):
    """The step part's own check (step/checks.py)."""
    step_checks.check(config.step, settings.Context())


def optim_check(config):
    """The optimizer part's own check (training/checks.py)."""
    optim_checks.check(config.optim, settings.Context())


def warmup_check(config):
    """The warm-up against the loop's --train_steps (training/checks.py)."""
    optim_checks.check_warmup(config.optim, config.train_steps)


def model_check(config):
    """The models part's own check (models/checks.py)."""
    model_checks.check(config.models, settings.Context())


def data_check(config):
    """The data part's own check (data/checks.py)."""
    data_checks.check(config.data, settings.Context())


def loop_check(config):
    """The loop part's own check (runs/loop_checks.py)."""
    loop_checks.check(config.loop, settings.Context())


def profile_check(config):
    """--profile_steps against the loop's --train_steps (runs/monitor.py)."""
    if config.profile_steps is not None:
        monitor.parse_profile_steps(config.profile_steps, config.train_steps)


def observe_check(config):
    """The observe part's own check (observe/checks.py)."""
    observe_checks.check(config.observe, settings.Context())


# (a function of a Config calling a package's check; a bad setting it owns,
# the line it refuses it with)
OWN_CHECKS = [
    (model_check, dict(model="resnet9000"), r"^--model='resnet9000' is not one of: big_mlp, "),
    (loop_check, dict(steps_per_loop=0), r"^--steps_per_loop=0 is out of range: must be >= 1$"),
    (optim_check, dict(optimizer="lion"),
     r"^--optimizer='lion' is not one of: adam, momentum, muon, sgd$"),
    (warmup_check, dict(warmup_steps=500), r"^--warmup_steps=500 is longer than --train_steps=400"),
    (data_check, dict(staging_depth=0), r"^--staging_depth=0 is out of range: must be >= 1$"),
    (step_check, dict(accumulation_steps=0), r"^--accumulation_steps=0 is out of range"),
    (step_check, dict(mixed_precision="fp8"), r"^--mixed_precision='fp8' is not one of"),
    (step_check, dict(batch_norm="ghost"), r"^--batch_norm='ghost' is not one of"),
    (step_check, dict(ordered_sum_bytes=-1), r"^--ordered_sum_bytes=-1 is out of range"),
    (step_check, dict(sufficient_factor_bytes=-1),
     r"^--sufficient_factor_bytes=-1 is out of range"),
    (step_check, dict(byzantine_choice="some"), r"^--byzantine_choice='some' is not one of"),
    (loop_check, dict(keep_checkpoints=0), r"^--keep_checkpoints=0 is out of range"),
    (profile_check, dict(profile_steps="4,2"), r"^--profile_steps='4,2' must be two steps A,B"),
    (observe_check, dict(links=("10gbit",)), r"^--link=10gbit"),
    (observe_check, dict(compute="a200"), r"^--compute=a200: 'a200' is not measured"),
]


@pytest.mark.parametrize("check, bad, pattern", OWN_CHECKS,
                         ids=[f"{c.__name__}:{next(iter(b))}" for c, b, _ in OWN_CHECKS])
def test_each_part_checks_its_own_settings_with_the_gates_line(check, bad, pattern, logdir):
    check(Config())  # the defaults pass
    with pytest.raises(mgloop.ConfigError, match=pattern) as own:
        check(Config(**bad))
    with pytest.raises(mgloop.ConfigError) as gate:  # validated() asks the module
        Config(logdir=logdir, **bad).validated()
    assert str(gate.value) == str(own.value)
    assert not os.path.exists(logdir)  # refused before the logdir was made


def test_data_resolves_the_batch_and_the_data_dir():
    context = settings.Context(num_towers=4, devices_flag="cpu:4")
    resolved = data_checks.check(Config().data, context)
    assert (resolved.global_batch_size, resolved.batch_size_per_tower, resolved.data_dir) == (
        data.DEFAULT_GLOBAL_BATCH_SIZE, data.DEFAULT_GLOBAL_BATCH_SIZE // 4, None)
    resolved = data_checks.check(Config(batch_size_per_tower=8).data, context)
    assert (resolved.global_batch_size, resolved.batch_size_per_tower) == (32, 8)
    assert data_checks.check(Config(dataset="python_text").data, context).sequence_length == 64
    with pytest.raises(mgloop.ConfigError, match=r"^--global_batch_size=30 does not split "
                       r"into 4 equal tower shards \(--devices=cpu:4\); use a multiple of 4$"):
        data_checks.check(Config(global_batch_size=30).data, context)


def test_models_resolve_the_models_own_settings_to_its_defaults():
    context = settings.Context()
    resolved = model_checks.check(Config().models, context)
    assert (resolved.mlp_width, resolved.mlp_depth) == (128, 2)
    assert resolved == dataclasses.replace(Config().models, mlp_width=128, mlp_depth=2)
    assert (resolved.lm_layers, resolved.lm_width, resolved.lm_heads) == (None, None, None)
    resolved = model_checks.check(Config(model="transformer_lm", lm_width=32).models, context)
    assert (resolved.lm_layers, resolved.lm_width, resolved.lm_heads) == (2, 32, 4)


def test_every_setting_says_whether_it_can_change_a_result():
    """A setting left out of HParams says why it cannot change a result."""
    for field in config_lib.setting_fields():
        hparam, neutral = field.metadata["hparam"], field.metadata["neutral"]
        assert hparam is True or (hparam is False and neutral.strip()), field.name
        assert not (hparam and neutral), field.name
    for result_changing in ("aggregation", "grad_reduce", "pack_bytes", "transport_dtype",
                            "ordered_sum_bytes", "sufficient_factor_bytes",
                            "accumulation_steps", "mixed_precision", "batch_norm", "model",
                            "dataset", "global_batch_size", "optimizer", "learning_rate",
                            "lr_schedule", "seed", "deterministic", "plugins"):
        assert result_changing in settings.hparam_names(config_lib.setting_fields())
    with pytest.raises(TypeError, match="either hparam=True"):
        settings.setting(1, "a setting that says neither")


def root_hparams(logdir):
    """{name: value} of the HParams session start in the root events of `logdir`."""
    for name in sorted(os.listdir(logdir)):
        if name.startswith("events"):
            for event in tf.compat.v1.train.summary_iterator(os.path.join(logdir, name)):
                for value in event.summary.value:
                    if value.metadata.plugin_data.plugin_name == "hparams":
                        record = plugin_data_pb2.HParamsPluginData.FromString(
                            value.metadata.plugin_data.content)
                        if record.HasField("session_start_info"):
                            return {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
                                    for k, v in record.session_start_info.hparams.items()}
    raise AssertionError(f"no HParams session in {logdir}")


def test_the_hparams_record_holds_every_setting_that_can_change_a_result(logdir):
    config = helpers.small_config(logdir, devices="cpu:2", aggregation="ring:shards=2",
                                  grad_reduce="sum", pack_bytes=4096, ordered_sum_bytes=1024,
                                  sufficient_factor_bytes=2048, learning_rate=0.01,
                                  train_steps=1, steps_per_loop=1)
    mgloop.run(config, train_data=helpers.DATASET)
    recorded = root_hparams(logdir)
    resolved = config.validated()
    # the method by name, each of its options apart (aggregation.describe); a setting of
    # another model or dataset (None once resolved, e.g. --lm_layers), or one left unset
    # (--node_failures: none; --node_speeds: equal nodes, a result of async_diloco's), is
    # not recorded
    hparams = settings.hparam_names(config_lib.setting_fields())
    unused = {name for name in hparams if getattr(resolved, name) is None}
    assert unused == {"sequence_length", "lm_layers", "lm_width", "lm_heads", "node_failures",
                      "node_speeds"}
    assert set(recorded) == set(hparams) - unused | {
        "num_towers", "aggregation/shards"}
    assert recorded["num_towers"] == 2 and recorded["aggregation/shards"] == 2
    for name in set(hparams) - unused:
        value = getattr(resolved, name)
        expected = ",".join(value) if isinstance(value, tuple) else value
        expected = "ring" if name == "aggregation" else expected
        assert recorded[name] == expected, name  # numbers come back as doubles: exact


def test_prepare_makes_a_fresh_logdir_under_the_temp_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(run_dir.tempfile, "tempdir", str(tmp_path))
    logdir = run_dir.prepare(None, None)
    assert os.path.isdir(logdir) and os.path.dirname(logdir) == str(tmp_path / "mgloop")
    assert os.listdir(logdir) == []  # the write probe is gone
    assert run_dir.prepare(str(tmp_path / "given"), str(tmp_path / "later" / "export")) == str(
        tmp_path / "given")
    assert not os.path.exists(tmp_path / "later")  # the export dir is probed, not made


def test_resume_compares_with_the_recorded_settings(tmp_path, caplog):
    """config.json as write_config records it (a tuple comes back as a list) is the same
    run; a changed CHECKPOINT_SHAPING setting is refused, another one logged."""
    first = Config(logdir=str(tmp_path), plugins=("my_methods",), global_batch_size=16)
    run_dir.write_config(first)
    with open(tmp_path / run_dir.CONFIG_FILENAME) as handle:
        assert json.load(handle)["plugins"] == ["my_methods"]
    run_dir.check_resumable(dataclasses.replace(first, seed=9))  # no checkpoints: no check
    os.makedirs(tmp_path / "checkpoints")
    (tmp_path / "checkpoints" / "ckpt-2.index").write_bytes(b"")
    with caplog.at_level(logging.INFO, logger="absl"):
        run_dir.check_resumable(first)
        assert "differ from their run" not in caplog.text
        run_dir.check_resumable(dataclasses.replace(first, learning_rate=0.5))
        assert "--learning_rate=0.5 (was 0.05)" in caplog.text and "plugins" not in caplog.text
    with pytest.raises(mgloop.ConfigError, match=r"^--seed=9 differs from 0 of the checkpoints"):
        run_dir.check_resumable(dataclasses.replace(first, seed=9))
