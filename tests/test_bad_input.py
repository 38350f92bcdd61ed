"""Bad settings: one clear line naming the flag, before any device or variable exists."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import mgloop
from mgloop import aggregation, data
from mgloop.cluster import devices
from mgloop.runs import assemble
from mgloop.training import model_input
from mgloop.training import variables
from tests import helpers


@pytest.fixture
def nothing_built(monkeypatch):
    """Fails the test if a run gets as far as setting up devices or building variables."""
    def refuse(*args, **kwargs):
        raise AssertionError("devices or variables were created before validation finished")
    monkeypatch.setattr(devices, "setup", refuse)
    monkeypatch.setattr(assemble, "build", refuse)


def file_path(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("not a directory")
    return str(path)


CASES = {
    "unknown aggregation": (dict(aggregation="allreduce_magic"),
                            r"^--aggregation='allreduce_magic' is not one of: .*ps_cpu.*ring"),
    "unknown model": (dict(model="resnet9000"), r"^--model='resnet9000' is not one of: big_mlp, cnn, minigooglenet, mlp, resnet20, transformer_lm$"),
    "unknown dataset": (dict(dataset="imagenet"), r"^--dataset='imagenet' is not one of"),
    "unknown optimizer": (dict(optimizer="lion"), r"^--optimizer='lion' is not one of"),
    "unknown schedule": (dict(lr_schedule="step"), r"^--lr_schedule='step' is not one of"),
    "batch not divisible": (dict(devices="cpu:4", global_batch_size=30),
                            r"^--global_batch_size=30 does not split into 4 .*multiple of 4"),
    "both batch sizes": (dict(global_batch_size=16, batch_size_per_tower=8),
                         r"^--global_batch_size and --batch_size_per_tower are both set"),
    "negative steps": (dict(train_steps=-5), r"^--train_steps=-5 is out of range: must be >= 0"),
    "zero steps per loop": (dict(steps_per_loop=0), r"^--steps_per_loop=0 is out of range"),
    "negative learning rate": (dict(learning_rate=-0.1), r"^--learning_rate=-0.1 is out of range"),
    "warmup too long": (dict(warmup_steps=50), r"^--warmup_steps=50 is longer than --train_steps"),
    "gpu without gpus": (dict(devices="gpu"), r"^--devices=gpu: no GPU is visible.*cpu:N"),
    "listed gpus without gpus": (dict(devices="gpu:0,2"), r"^--devices=gpu:0,2: no GPU"),
    "malformed devices": (dict(devices="tpu:8"), r"^--devices='tpu:8' is not understood"),
    "zero cpus": (dict(devices="cpu:0"), r"^--devices=cpu:0: needs at least one"),
    "unknown reduction": (dict(grad_reduce="max"), r"^--grad_reduce='max' is not one of: mean, sum"),
    "unknown transport": (dict(transport_dtype="int8"),
                          r"^--transport_dtype='int8' is not one of: bfloat16, float16, float32"),
    "transport with shared variables": (
        dict(aggregation="ps_cpu", transport_dtype="float16"),
        r"^--transport_dtype=float16 means nothing with --aggregation=ps_cpu \(shared"),
    "transport without exchange": (
        dict(aggregation="independent", transport_dtype="bfloat16"),
        r"^--transport_dtype=bfloat16 means nothing with --aggregation=independent, which "
        r"exchanges no gradients"),
    "transport with collective": (
        dict(aggregation="collective", transport_dtype="float16", devices="cpu:2"),
        r"^--transport_dtype=float16 with --aggregation=collective: its kernel sums in"),
    "packing without exchange": (dict(aggregation="colocate", pack_bytes=1024),
                                 r"^--pack_bytes=1024 means nothing with --aggregation=colocate"),
    "packing across devices": (dict(aggregation="ps_spread", pack_bytes=1024),
                               r"^--pack_bytes=1024 with --aggregation=ps_spread: a bucket"),
    "negative packing": (dict(pack_bytes=-1), r"^--pack_bytes=-1 is out of range"),
    "negative ordered sum": (dict(ordered_sum_bytes=-1),
                             r"^--ordered_sum_bytes=-1 is out of range: must be >= 0"),
    "negative sufficient factors": (dict(sufficient_factor_bytes=-1),
                                    r"^--sufficient_factor_bytes=-1 is out of range: must be >= 0"),
    "ring shards elsewhere": (dict(aggregation="ps_cpu:shards=2"),
                              r"^--aggregation=ps_cpu:shards=2: ps_cpu has no option 'shards'; "
                              r"ps_cpu takes no options$"),
    "unknown option": (dict(aggregation="ring:shard=2"),
                       r"^--aggregation=ring:shard=2: ring has no option 'shard'; its options: "
                       r"shards \(int >= 1, default 1\): parallel rings"),
    "option not a number": (dict(aggregation="ring:shards=two"),
                            r"^--aggregation=ring:shards=two: ring option shards='two' is not "
                            r"an int; shards \(int >= 1"),
    "option out of range": (dict(aggregation="ring:shards=0"),
                            r"^--aggregation=ring:shards=0: ring option shards=0 is out of "
                            r"range: must be >= 1$"),
    "option given twice": (dict(aggregation="ring:shards=2,shards=3"),
                           r"^--aggregation=ring:shards=2,shards=3: ring option shards is given "
                           r"twice; give each option once$"),
    "groups not dividing": (dict(aggregation="hierarchical:groups=3", devices="cpu:4"),
                            r"^--aggregation=hierarchical:groups=3: 3 groups do not divide the 4 "
                            r"towers; use groups= one of: 1, 2, 4$"),
    "plugin missing": (dict(plugins=("no_such_mgloop_plugin",)),
                       r"^--plugin=no_such_mgloop_plugin failed to import: "
                       r"ModuleNotFoundError: No module named 'no_such_mgloop_plugin'; fix the module or "
                       r"leave that --plugin out$"),
    "plugin file missing": (dict(plugins=("/nonexistent/methods.py",)),
                            r"^--plugin=/nonexistent/methods.py failed to import: "
                            r"FileNotFoundError: no file /nonexistent/methods.py; fix the module or "
                            r"leave that --plugin out$"),
    "packing a gathering method": (
        dict(aggregation="topk_ef", plugins=("tests.plugins.topk_ef",), pack_bytes=4096),
        r"^--pack_bytes=4096 with --aggregation=topk_ef: it gathers each tower's top-k values "
        r"and indices"),
    "nccl without gpus": (dict(aggregation="nccl", devices="cpu:2"),
                          r"^--aggregation=nccl needs GPU towers"),
    "zero accumulation steps": (dict(accumulation_steps=0),
                                r"^--accumulation_steps=0 is out of range: must be >= 1$"),
    "unknown precision": (dict(mixed_precision="float16"),
                          r"^--mixed_precision='float16' is not one of: mixed_bfloat16, "
                          r"mixed_float16, none$"),
    "unknown batch norm": (dict(batch_norm="cross_replica"),
                           r"^--batch_norm='cross_replica' is not one of: per_tower, sync$"),
    "sync batch norm with colocate": (
        dict(devices="cpu:2", aggregation="colocate", batch_norm="sync"),
        r"^--batch_norm=sync with --aggregation=colocate, which re-creates multi_gpu_model"),
    "sync batch norm with independent": (
        dict(devices="cpu:2", aggregation="independent", batch_norm="sync"),
        r"^--batch_norm=sync with --aggregation=independent, which trains each replica alone"),
    "unknown staging": (dict(staging="gpu_direct"),
                        r"^--staging='gpu_direct' is not one of: device, host, none$"),
    "zero staging depth": (dict(staging_depth=0),
                           r"^--staging_depth=0 is out of range: must be >= 1$"),
    "negative staging depth": (dict(staging_depth=-2),
                               r"^--staging_depth=-2 is out of range: must be >= 1$"),
    "negative eval interval": (dict(eval_every=-1), r"^--eval_every=-1 is out of range"),
    "negative histogram interval": (dict(histogram_every=-2),
                                    r"^--histogram_every=-2 is out of range"),
    "negative breakdown interval": (dict(breakdown_every=-1),
                                    r"^--breakdown_every=-1 is out of range"),
    "profile steps reversed": (dict(profile_steps="4,2"),
                               r"^--profile_steps='4,2' must be two steps A,B with 0 <= A < B "
                               r"<= --train_steps=5"),
    "profile steps past the end": (dict(profile_steps="1,9"), r"^--profile_steps='1,9' must be"),
    "profile steps malformed": (dict(profile_steps="3"), r"^--profile_steps='3' must be"),
    # the Python API can give an integer setting a float or a bool, which the range passes
    "fractional train steps": (dict(train_steps=1.5),
                               r"^--train_steps=1\.5 is not an integer; give a whole number$"),
    "float mlp depth": (dict(mlp_depth=2.0),
                        r"^--mlp_depth=2\.0 is not an integer; give a whole number$"),
    "boolean mlp width": (dict(mlp_width=True),
                          r"^--mlp_width=True is not an integer; give a whole number$"),
    "nan mlp depth": (dict(mlp_depth=float("nan")),
                      r"^--mlp_depth=nan is not a finite number; give a finite one$"),
    # NaN and inf pass every comparison, so each float setting is checked to be finite
    "nan learning rate": (dict(learning_rate=float("nan")),
                          r"^--learning_rate=nan is not a finite number; give a finite one$"),
    "inf learning rate": (dict(learning_rate=float("inf")),
                          r"^--learning_rate=inf is not a finite number; give a finite one$"),
    "nan momentum": (dict(momentum=float("nan")),
                     r"^--momentum=nan is not a finite number; give a finite one$"),
    "nan weight decay": (dict(weight_decay=float("nan")),
                         r"^--weight_decay=nan is not a finite number; give a finite one$"),
    "inf lr power": (dict(lr_power=float("inf")),
                     r"^--lr_power=inf is not a finite number; give a finite one$"),
    "nan startup timeout": (dict(startup_timeout=float("nan")),
                            r"^--startup_timeout=nan is not a finite number; give a finite "
                            r"one$"),
    "inf collective timeout": (dict(collective_timeout=float("inf")),
                               r"^--collective_timeout=inf is not a finite number; give a "
                               r"finite one$"),
    "seed past numpy's 32 bits": (dict(seed=2**32),
                                  r"^--seed=4294967296 is out of range: must be >= 0 and "
                                  r"<= 4294967295$"),
    "too many logical cpus": (dict(devices="cpu:1000", global_batch_size=1000),
                              r"^--devices=cpu:1000: at most 64 logical CPU devices .*"
                              r"N <= 64$"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_setting_is_refused_before_building(case, logdir, nothing_built, gpus):
    gpus(0)
    overrides, pattern = CASES[case]
    with pytest.raises(mgloop.ConfigError, match=pattern) as error:
        mgloop.run(helpers.small_config(logdir, **overrides))
    assert "\n" not in str(error.value)


def test_unwritable_logdir(tmp_path, nothing_built):
    logdir = os.path.join(file_path(tmp_path), "run")  # a directory below a file cannot exist
    with pytest.raises(mgloop.ConfigError, match=r"^--logdir=.* is not a writable directory"):
        mgloop.run(helpers.small_config(logdir))


def test_logdir_that_is_a_file(tmp_path, nothing_built):
    with pytest.raises(mgloop.ConfigError, match=r"^--logdir=.* is an existing file"):
        mgloop.run(helpers.small_config(file_path(tmp_path)))


def test_export_dir_that_is_a_file(tmp_path, logdir, nothing_built):
    with pytest.raises(mgloop.ConfigError, match=r"^--export_dir=.* is an existing file"):
        mgloop.run(helpers.small_config(logdir, export_dir=file_path(tmp_path)))


def test_batch_larger_than_an_epoch_with_drop_remainder(logdir, nothing_built):
    tiny = data.synthetic.make(seed=0, num_train=10, num_eval=4)
    with pytest.raises(mgloop.ConfigError, match=r"^--drop_remainder=true: "
                       r"--global_batch_size=16 is larger than the 10 training examples of "
                       r"--dataset=synthetic.*--global_batch_size <= 10 or "
                       r"--drop_remainder=false$"):
        mgloop.run(helpers.small_config(logdir), train_data=tiny)


def test_empty_eval_split_is_refused_before_building(logdir, nothing_built):
    no_eval = data.synthetic.make(seed=0, num_train=32, num_eval=0)
    with pytest.raises(mgloop.ConfigError, match=r"^--dataset=synthetic has no eval examples, "
                       r"but every run evaluates after training.*at least one eval example$"):
        mgloop.run(helpers.small_config(logdir), train_data=no_eval)


def test_model_input_that_does_not_fit_the_data_is_refused_before_its_copies(logdir,
                                                                             monkeypatch):
    """A keras.Input((32,)) model on 8x8x3 examples: one line naming both shapes, raised
    once the template exists and before any variable copy is made."""
    def refuse(*args, **kwargs):
        raise AssertionError("variable copies were made before the input shape was checked")
    monkeypatch.setattr(variables, "make_copies", refuse)
    flat = lambda: keras.Sequential([keras.Input((32,)), keras.layers.Dense(10)])  # noqa: E731
    with pytest.raises(mgloop.ConfigError) as error:
        mgloop.run(helpers.small_config(logdir), model_fn=flat, train_data=helpers.DATASET)
    assert str(error.value) == (
        "the model's input shape (None, 32) does not fit the data (--dataset): examples of "
        "shape (8, 8, 3), batches (None, 8, 8, 3); build the model on "
        "keras.Input(shape=(8, 8, 3))")


@pytest.mark.parametrize("declared,fits", [
    ((8, 8, 3), True), ((None, None, 3), True), ((8, 8, 3, 1), True),  # Keras adds the 1
    ((32,), False), ((8, 8, 4), False), ((8, 8), False), ((None, 8, 4), False)])
def test_model_input_check_follows_keras_rank_rule(declared, fits):
    """Accepted when every declared dimension matches (None matches any), after Keras's own
    change of rank (a trailing 1); the accepted ones do run in Keras."""
    model = keras.Sequential([keras.Input(declared), keras.layers.Flatten()])
    if fits:
        model_input.check_fits_data(model, (8, 8, 3))
        assert model(np.zeros((2, 8, 8, 3), np.float32)).shape[0] == 2
    else:
        with pytest.raises(mgloop.ConfigError, match=r"^the model's input shape .* does not "
                           r"fit the data \(--dataset\): examples of shape \(8, 8, 3\)"):
            model_input.check_fits_data(model, (8, 8, 3))


def test_cli_prints_one_line_and_exits_2(tmp_path):
    logdir = tmp_path / "never_created"
    result = subprocess.run(
        [sys.executable, "-m", "mgloop.train", "--aggregation=nope", f"--logdir={logdir}"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("mgloop.train:")]
    builtin = [n for n in aggregation.names()  # as a fresh process has them: no plugins
               if aggregation.get(n).__module__.startswith("mgloop.")]
    assert "ring" in builtin and "ps_cpu" in builtin
    assert errors == ["mgloop.train: error: --aggregation='nope' is not one of: "
                      + ", ".join(builtin)]
    assert not logdir.exists()
