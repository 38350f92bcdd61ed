"""`python -m mgloop.train` end to end, its TensorBoard logs read by a real TensorBoard."""

import importlib
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from mgloop.runs import config as config_lib
from mgloop.runs import quiet_start
from mgloop import settings
from tests import tensorboard_server

CHANCE = 0.1  # the synthetic task has 10 classes
# TensorFlow's start-up lines (native: absl's notice, oneDNN, CUDA, CPU features) and the
# line its checkpoint saver logs per checkpoint; quiet by default (mgloop/runs/quiet_start.py).
START_UP_NOISE = re.compile(r"absl::InitializeLog|port\.cc:|cudart_stub|cuInit|"
                            r"cpu_feature_guard|Sharding callback duration")
NATIVE_LOG_LINE = re.compile(r"^[IWE]\d{4} [\d:.]+ +\d+ \S+\.cc:\d+\] ", re.MULTILINE)


def train(*flags, timeout=600, log_level=None):
    """Runs the CLI; `log_level`: TF_CPP_MIN_LOG_LEVEL as the user sets it (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    if log_level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = log_level
    result = subprocess.run([sys.executable, "-m", "mgloop.train", *flags],
                            capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def summary_of(logdir):
    with open(os.path.join(logdir, "summary.json")) as handle:
        return json.load(handle)


def test_default_run_learns_and_logs_to_tensorboard(tmp_path):
    logdir = str(tmp_path / "default")
    result = train(f"--logdir={logdir}", "--diagnostics", "--histogram_every=200",
                   "--eval_every=200", "--breakdown_every=200")
    summary = summary_of(logdir)
    if summary["simulated_devices"]:
        assert summary["num_towers"] == 2
        assert "towers are simulated" in result.stderr
    assert summary["eval_accuracy"] > 5 * CHANCE
    assert summary["final_train_accuracy"] > 5 * CHANCE
    assert summary["final_step"] == summary["config"]["train_steps"]
    assert summary["examples_per_sec"] > 0 and summary["median_step_time"] > 0
    assert summary["input_wait"] >= 0 and 0 <= summary["input_wait_fraction"] < 1
    assert summary["input_ended"] is False
    assert "ETA" in result.stderr  # progress lines
    assert not START_UP_NOISE.findall(result.stderr)  # quiet by default (checkpoints included)
    steps = summary["config"]["train_steps"]
    every = summary["config"]["summary_every"]
    with tensorboard_server.serve(logdir) as board:
        tags = board.wait_for(lambda t: "loss" in t.get("eval", {}) and "loss" in t.get("train", {}),
                              "/data/plugin/scalars/tags")
        assert {"loss", "accuracy", "learning_rate", "examples_per_sec",
                "step_time", "input_wait"} <= set(tags["train"])
        assert {"loss", "accuracy"} <= set(tags["eval"])
        for device, counts in summary["traffic_bytes_per_step"].items():
            tag = f"traffic/{device.replace(':', '_')}/sent_bytes"
            (_, step, sent), = board.scalars("train", tag)
            assert (step, sent) == (steps, counts["sent"])
        assert summary["traffic_bytes_per_step"]["CPU:1"]["sent"] > 0  # tower 1 sends gradients
        (_, _, exchange), = board.scalars("train", "exchange_seconds")
        assert exchange == pytest.approx(summary["exchange_seconds"], rel=1e-6) and exchange > 0
        loss = board.scalars("train", "loss")
        assert [step for _, step, _ in loss] == list(range(every, steps + 1, every))
        assert loss[-1][2] < 0.5 * loss[0][2]  # the loss fell
        waits = board.scalars("train", "input_wait")
        assert len(waits) == len(loss) and all(0 <= w < 1 for _, _, w in waits)
        evals = board.scalars("eval", "accuracy")
        assert [step for _, step, _ in evals] == [200, steps]  # --eval_every=200
        assert abs(evals[-1][2] - summary["eval_accuracy"]) < 1e-6
        towers = summary["num_towers"]
        tower_losses = [board.scalars("train", f"tower_{t}/loss") for t in range(towers)]
        for t in range(towers):  # a sample (the window's last step) at every summary
            assert [s for _, s, _ in tower_losses[t]] == [s for _, s, _ in loss]
            assert all(v > 0 for _, _, v in board.scalars("train", f"tower_{t}/grad_norm"))
        for phase in ("input", "compute", "aggregation", "apply"):  # --breakdown_every=200
            times = board.scalars("train", f"breakdown/{phase}")
            assert [s for _, s, _ in times] == [200, steps]
            # (the input's get-next is asynchronous, traced with no duration: >= 0)
            least = 0 if phase == "input" else 1e-9
            assert all(least <= t <= span for (_, _, t), (_, _, span) in
                       zip(times, board.scalars("train", "breakdown/step")))
        if towers > 1:
            assert all(-1 <= c <= 1 for _, _, c in board.scalars("train", "grad/cosine_mean"))
        assert all(0 < r <= 1 for _, _, r in board.scalars("train", "grad/norm_ratio"))
        assert {d for _, _, d in board.scalars("train", "replica/divergence")} == {0.0}
        assert board.scalars("train", "memory/host/peak_rss_bytes")[-1][2] > 0
        histogram = board.get("/data/plugin/histograms/histograms", run="train",
                              tag="gradients/mlp/dense/kernel")
        assert [step for _, step, _ in histogram] == [200, steps]
        counts = [sum(count for _, _, count in buckets) for _, _, buckets in histogram]
        assert counts[0] == counts[1] > 100  # every element of the kernel, each time
        groups = board.get("/data/plugin/hparams/session_groups", request=json.dumps(
            {"startIndex": 0, "sliceSize": 10, "allowedStatuses": ["STATUS_UNKNOWN"]}))
        (group,) = groups["sessionGroups"]
        assert group["hparams"]["aggregation"] == summary["config"]["aggregation"]
        assert group["hparams"]["num_towers"] == towers
        # every setting that can change a result, as TensorBoard reads it (but another
        # model's or dataset's, None in the run's config, e.g. --lm_layers)
        used = {n for n in settings.hparam_names(config_lib.setting_fields())
                if summary["config"][n] is not None}
        assert set(group["hparams"]) == used | {"num_towers"}
        assert group["hparams"]["grad_reduce"] == summary["config"]["grad_reduce"]
        metrics = {m["name"]["tag"]: m["value"] for m in group["metricValues"]}
        assert metrics["final/eval_accuracy"] == pytest.approx(summary["eval_accuracy"])
        assert metrics["final/examples_per_sec"] == pytest.approx(summary["examples_per_sec"],
                                                                  rel=1e-6)
        (command,) = board.get("/data/plugin/text/text", run=".", tag="command_line")
        assert shlex.join(["--diagnostics", "--histogram_every=200"]) in command["text"]


def test_display_modules_are_held_back_only_while_tensorflow_loads(monkeypatch):
    """Keras imports IPython (notebook display) and matplotlib (its image-gallery plots) when
    it can: the entry points, and this test process (conftest.py), load TensorFlow with both
    held back, so Keras took the failed imports; afterwards they import as usual, Keras's
    plotting reaches pyplot at first use, and a notebook's IPython stays; where TensorFlow
    is loaded already nothing is held back."""
    from keras.src.saving import file_editor
    from keras.src.visualization import plot_bounding_box_gallery, plot_image_gallery
    assert file_editor.ipython is None
    import matplotlib.patches
    import matplotlib.pyplot
    assert plot_image_gallery.plt.subplots is matplotlib.pyplot.subplots
    assert plot_bounding_box_gallery.patches.Patch is matplotlib.patches.Patch
    for name in ("IPython", "matplotlib"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with quiet_start.without_display_modules():  # TensorFlow loaded: nothing held back
        assert "IPython" not in sys.modules and "matplotlib" not in sys.modules
    monkeypatch.delitem(sys.modules, "tensorflow")  # as before it loads (its modules cached)
    with quiet_start.without_display_modules():
        for name in ("IPython", "matplotlib"):
            with pytest.raises(ImportError):
                importlib.import_module(name)
    assert "IPython" not in sys.modules and "matplotlib" not in sys.modules
    notebook = object()
    monkeypatch.setitem(sys.modules, "IPython", notebook)
    with quiet_start.without_display_modules():
        assert sys.modules["IPython"] is notebook
    assert sys.modules["IPython"] is notebook


def test_the_packages_api_loads_its_modules_with_the_display_modules_held_back(monkeypatch):
    """`import mgloop; mgloop.run(...)` in a user's script loads TensorFlow on first use of
    the API, inside `without_display_modules` as the entry points do (`python -m
    experiments.startup --cases=mgloop_run,tensorflow`); which holds nothing back where
    TensorFlow is loaded already (the test above)."""
    import contextlib

    import mgloop
    entered = []

    @contextlib.contextmanager
    def recording():
        entered.append(True)
        yield

    monkeypatch.setattr(quiet_start, "without_display_modules", recording)
    assert mgloop.Config is not None and mgloop.run is not None
    assert entered == [True, True]


def test_four_ring_towers_learn(tmp_path):
    logdir = str(tmp_path / "ring4")
    result = train("--devices=cpu:4", "--aggregation=ring", "--train_steps=150",
                   f"--logdir={logdir}", log_level="0")
    # the user's TF_CPP_MIN_LOG_LEVEL is honoured: TensorFlow logs as it would without mgloop
    assert NATIVE_LOG_LINE.search(result.stderr) and "Sharding callback duration" in result.stderr
    summary = summary_of(logdir)
    assert summary["num_towers"] == 4 and summary["config"]["aggregation"] == "ring"
    assert summary["eval_accuracy"] > 5 * CHANCE
    assert sorted(os.listdir(os.path.join(logdir, "checkpoints")))[0] == "checkpoint"
