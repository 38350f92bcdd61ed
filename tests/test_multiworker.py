"""Several processes on TensorFlow's runtime: TF_CONFIG, gRPC, collective ops, on loopback.

Each test starts real worker processes through `python -m mgloop.launch`.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import mgloop
from mgloop import checkpoint
from tests import helpers
from tests import tolerance

SETTINGS = ["--model=mlp", "--global_batch_size=512", "--steps_per_loop=10", "--log_every=10",
            "--checkpoint_every=10", "--summary_every=0", "--deterministic", "--seed=3",
            "--learning_rate=0.05", "--collective_timeout=30", "--aggregation=ring"]
STEPS = 60


def launcher(logdir, export_dir, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "mgloop.launch", "--num_workers=2", "--devices_per_worker=cpu:2",
         "--", f"--logdir={logdir}", f"--export_dir={export_dir}", f"--train_steps={STEPS}",
         *SETTINGS, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"})


def weights(export_dir):
    return keras.models.load_model(os.path.join(export_dir, checkpoint.EXPORT_FILENAME)
                                   ).get_weights()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One uninterrupted 2 workers x 2 towers run, kept for the tests below."""
    root = tmp_path_factory.mktemp("straight")
    process = launcher(root / "run", root / "export", "--keep_checkpoints=10")
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-3000:]
    assert "[worker 1]" in output and "[worker 0]" in output
    noise = [line for line in output.splitlines() if re.search(  # quiet_start.py
        r"absl::InitializeLog|port\.cc:|cudart_stub|cuInit|cpu_feature_guard|Sharding callback",
        line)]
    assert not noise, noise[:5]
    return root


def test_two_workers_of_two_towers_equal_one_worker_of_four(straight, tmp_path):
    """At step 10: both lie within the float32 bound of the one-device run of those steps
    (tests/tolerance.py), so within twice it of each other."""
    summary = json.loads((straight / "run" / "summary.json").read_text())
    assert (summary["num_workers"], summary["num_towers"]) == (2, 4)
    events = os.listdir(straight / "run" / "train")
    assert len(events) == 1, events  # the chief alone writes summaries
    assert sorted(os.listdir(straight / "export")) == ["model.keras"]
    config = helpers.small_config(
        str(tmp_path / "single"), devices="cpu:4", aggregation="ring", global_batch_size=512,
        steps_per_loop=10, learning_rate=0.05, train_steps=10, seed=3,
        export_dir=str(tmp_path / "single_export"))
    single = mgloop.run(config)
    assert single["num_towers"] == 4
    model = keras.models.load_model(tmp_path / "single_export" / checkpoint.EXPORT_FILENAME)
    expected = model.get_weights()
    status = tf.train.Checkpoint(model=model).restore(
        str(straight / "run" / "checkpoints" / "ckpt-10"))
    status.assert_existing_objects_matched()  # every weight came from the cluster's step 10
    status.expect_partial()  # (its optimizer and step are not needed here)
    bound = helpers.bound_of_run(config, 10)
    tolerance.assert_within(model.get_weights(), expected, [2 * t for t in bound.weights()])


def test_a_killed_worker_stops_the_job_and_a_restart_resumes(straight, tmp_path):
    logdir = tmp_path / "run"
    process = launcher(logdir, tmp_path / "export", "--train_steps=100000")
    pids, lines, began = {}, [], time.monotonic()
    for line in process.stdout:
        lines.append(line)
        started = re.match(r"\[launch\] worker (\d) .*\(pid (\d+)\)", line)
        if started:
            pids[int(started.group(1))] = int(started.group(2))
        if re.match(r"\[worker 0\] .*step 30/", line):
            break
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    output, _ = process.communicate(timeout=120)
    output = "".join(lines) + output
    assert process.returncode != 0
    assert time.monotonic() - killed < 60
    assert "[launch] worker 1 was killed by signal SIGKILL" in output
    assert re.search(r"\[worker 0\] mgloop.train: error: lost the other workers", output)
    assert os.path.exists(logdir / "checkpoints" / "checkpoint")  # the chief's, kept

    restart = launcher(logdir, tmp_path / "export")
    output, _ = restart.communicate(timeout=300)
    assert restart.returncode == 0, output[-3000:]
    resumed = re.search(r"resumed from .*ckpt-(\d+) at step (\d+)", output)
    assert resumed and int(resumed.group(2)) >= 30
    for a, b in zip(weights(tmp_path / "export"), weights(straight / "export")):
        np.testing.assert_array_equal(a, b)
