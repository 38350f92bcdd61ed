"""A method from the user's own module, reached through `--plugin`, end to end.

tests/plugins/topk_ef.py (top-k with error feedback: an option, per-tower residuals
built in `build`, lossy, not summable) and tests/plugins/bn_mlp.py (a model with
batch norm) are loaded by `python -m mgloop.train --plugin=...` and by
`python -m mgloop.launch` on 2 workers. The method raises if it is ever handed a
non-trainable variable, so a run with batch norm that ends shows that the moving
statistics never reached it. A run stopped at step 3 and resumed to step 6 ends
bit-identical (--deterministic) to a straight run of 6 steps, its residuals
included: without them restored, step 4 would differ.
"""

import json
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf
from tensorboard.plugins.hparams import plugin_data_pb2

from mgloop import aggregation
from mgloop.runs import checkpoint
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN_FLAGS = ["--plugin=tests.plugins.topk_ef", "--plugin=tests.plugins.bn_mlp"]
RUN_FLAGS = ["--aggregation=topk_ef:ratio=0.5", "--model=bn_mlp", "--global_batch_size=32",
             "--steps_per_loop=3", "--log_every=0", "--summary_every=0", "--deterministic",
             "--seed=5", "--learning_rate=0.05"]


def run(module, *flags, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}  # quiet start
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, "-m", module, *flags], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def train(*flags):
    result = run("mgloop.train", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def tensors(logdir, step):
    reader = tf.train.load_checkpoint(os.path.join(logdir, "checkpoints", f"ckpt-{step}"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if not name.startswith("_CHECKPOINTABLE_OBJECT_GRAPH")}


def hparams_of(logdir):
    """The HParams session-start values written to the root run of `logdir`."""
    values = {}
    for name in os.listdir(logdir):
        if not name.startswith("events."):
            continue
        for event in tf.compat.v1.train.summary_iterator(os.path.join(logdir, name)):
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name != "hparams":
                    continue
                data = plugin_data_pb2.HParamsPluginData.FromString(
                    value.metadata.plugin_data.content)
                for key, entry in data.session_start_info.hparams.items():
                    values[key] = getattr(entry, entry.WhichOneof("kind"))
    return values


def test_plugin_method_trains_resumes_bit_identically_and_records_its_options(tmp_path):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    train(*PLUGIN_FLAGS, *RUN_FLAGS, "--devices=cpu:2", "--train_steps=6",
          "--checkpoint_every=3", f"--logdir={straight}")
    flagfile = tmp_path / "plugin.flags"  # --plugin from a flagfile too
    flagfile.write_text("\n".join(PLUGIN_FLAGS + RUN_FLAGS + ["--devices=cpu:2"]) + "\n")
    train(f"--flagfile={flagfile}", "--train_steps=3", f"--logdir={resumed}")
    train(f"--flagfile={flagfile}", "--train_steps=6", f"--logdir={resumed}")
    with open(os.path.join(resumed, "summary.json")) as handle:
        summary = json.load(handle)
    assert summary["start_step"] == 3 and summary["final_step"] == 6
    assert np.isfinite(summary["eval_loss"])
    expected, actual = tensors(straight, 6), tensors(resumed, 6)
    residuals = [n for n in expected if n.startswith("aggregation_state/topk_ef/")]
    assert len(residuals) == 2 * 6  # 2 towers x (2 Dense kernels and biases, BN gamma, beta)
    assert any(np.abs(expected[n]).max() > 0 for n in residuals)  # the residuals are in use
    assert set(actual) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(actual[name], value, err_msg=name)
    recorded = hparams_of(straight)
    assert recorded["aggregation"] == "topk_ef" and recorded["aggregation/ratio"] == 0.5


def test_plugin_method_across_two_workers(tmp_path):
    logdir = str(tmp_path / "workers")
    result = run("mgloop.launch", "--num_workers=2", "--devices_per_worker=cpu:2", "--",
                 *PLUGIN_FLAGS, *RUN_FLAGS, "--train_steps=6", "--checkpoint_every=3",
                 "--collective_timeout=30", f"--logdir={logdir}")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    with open(os.path.join(logdir, "summary.json")) as handle:
        summary = json.load(handle)
    assert summary["num_workers"] == 2 and summary["num_towers"] == 4
    assert summary["final_step"] == 6 and np.isfinite(summary["eval_loss"])
    saved = tensors(logdir, 6)
    assert sum(n.startswith("aggregation_state/topk_ef/") for n in saved) == 2 * 6


def test_plugin_that_fails_to_import_is_one_line(tmp_path):
    result = run("mgloop.train", "--plugin=tests.plugins.no_such_module",
                 f"--logdir={tmp_path / 'bad'}")
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert lines == ["mgloop.train: error: --plugin=tests.plugins.no_such_module failed to "
                     "import: ModuleNotFoundError: No module named "
                     "'tests.plugins.no_such_module'; fix the module or leave that --plugin out"]


def test_describe_gives_every_option_of_a_spec():
    aggregation.load_plugins(["tests.plugins.topk_ef"])
    assert aggregation.describe("topk_ef:ratio=0.25") == {"aggregation": "topk_ef",
                                                          "aggregation/ratio": 0.25}
    assert aggregation.describe("ring") == {"aggregation": "ring", "aggregation/shards": 1}
    assert aggregation.canonical_spec(" ring : shards=1 ") == "ring"
    assert aggregation.canonical_spec("hierarchical:groups=4") == "hierarchical:groups=4"


def test_switching_to_or_from_a_stateful_method_on_resume(tmp_path):
    """A checkpoint without the method's state (written by ring) resumes as topk_ef with
    its residuals as `build` made them; one with them resumes as ring (they are unused)."""
    aggregation.load_plugins(["tests.plugins.topk_ef"])
    folder = str(tmp_path / "checkpoints")

    def trainer_and_checkpointer(spec):
        trainer = helpers.build_trainer(helpers.small_config(
            str(tmp_path), devices="cpu:2", aggregation=spec, plugins=("tests.plugins.topk_ef",)))
        return trainer, checkpoint.Checkpointer(
            folder, trainer.model, trainer.copies[0].optimizer, trainer.global_step, keep=2,
            aggregation=trainer.aggregation)

    ring, ring_saver = trainer_and_checkpointer("ring")
    helpers.run_batches(ring, helpers.batches(2))
    ring_saver.save(2)
    topk, topk_saver = trainer_and_checkpointer("topk_ef:ratio=0.5")
    assert topk_saver.restore_latest().endswith("ckpt-2")
    assert int(topk.global_step.numpy()) == 2
    assert all(not np.any(v.numpy()) for v in topk.aggregation.state_variables)
    helpers.run_batches(topk, helpers.batches(3)[2:])
    topk_saver.save(3)
    again, again_saver = trainer_and_checkpointer("ring")
    assert again_saver.restore_latest().endswith("ckpt-3")
    np.testing.assert_array_equal(again.copies[0].trainable[0].numpy(),
                                  topk.copies[0].trainable[0].numpy())
