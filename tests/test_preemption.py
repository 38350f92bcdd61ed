"""SIGTERM / SIGINT: the run stops after the current loop with a checkpoint of that step
(issue 13, item 3; mgloop/runs/preemption.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import tensorflow as tf

from mgloop.runs import preemption

TRAIN_STEPS = 1000
FLAGS = ["--model=mlp", "--devices=cpu:2", "--deterministic", f"--train_steps={TRAIN_STEPS}",
         "--steps_per_loop=5", "--log_every=50", "--checkpoint_every=100000"]


def start(logdir, *flags):
    return subprocess.Popen([sys.executable, "-m", "mgloop.train", f"--logdir={logdir}",
                             *FLAGS, *flags], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))


def read_until(process, text) -> list[str]:
    """stderr lines up to the first holding `text` (all of them if it never comes)."""
    lines = []
    for line in process.stderr:
        lines.append(line)
        if text in line:
            break
    return lines


def checkpoint_arrays(logdir, step) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(os.path.join(logdir, "checkpoints", f"ckpt-{step}"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if not name.startswith(("_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter"))}


def test_sigterm_saves_the_step_and_the_restart_equals_an_uninterrupted_run(tmp_path):
    straight_dir, stopped_dir = tmp_path / "straight", tmp_path / "stopped"
    straight = start(straight_dir)  # side by side with the interrupted run
    stopped = start(stopped_dir)
    read_until(stopped, "step 50/")
    stopped.send_signal(signal.SIGTERM)
    err = stopped.communicate(timeout=600)[1]
    assert stopped.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Traceback" not in err
    with open(stopped_dir / "summary.json") as handle:
        preempted = json.load(handle)["preempted"]
    assert preempted["signal"] == "SIGTERM" and 50 <= preempted["step"] < TRAIN_STEPS
    assert tf.train.latest_checkpoint(str(stopped_dir / "checkpoints")).endswith(
        f"ckpt-{preempted['step']}")  # the step it stopped at, not an older one
    assert sum("stopped by SIGTERM after step" in line for line in err.splitlines()) == 1

    resumed = start(stopped_dir)
    err = resumed.communicate(timeout=600)[1]
    assert resumed.returncode == 0, err[-3000:]
    assert f"resumed from {stopped_dir}/checkpoints/ckpt-{preempted['step']}" in err
    straight.communicate(timeout=600)
    assert straight.returncode == 0
    expected, got = (checkpoint_arrays(d, TRAIN_STEPS) for d in (straight_dir, stopped_dir))
    assert expected.keys() == got.keys()
    for name in expected:  # --deterministic: the same ops on the same batches, bit for bit
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_a_second_signal_exits_at_once_inside_a_long_loop(tmp_path):
    # one loop of all the steps: only the second signal can end it early
    process = start(tmp_path, "--steps_per_loop=100000", "--train_steps=100000")
    read_until(process, "logdir:")
    process.send_signal(signal.SIGTERM)
    read_until(process, "received SIGTERM")
    process.send_signal(signal.SIGTERM)
    err = process.communicate(timeout=300)[1]
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "received SIGTERM again: exiting at once" in err
    assert not os.path.exists(tmp_path / "summary.json")
    assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")) is None


def test_handlers_only_on_the_main_thread_and_restored_after():
    before = {s: signal.getsignal(s) for s in preemption.SIGNALS}
    with preemption.StopOnSignal():
        assert all(signal.getsignal(s) is not before[s] for s in preemption.SIGNALS)
    assert {s: signal.getsignal(s) for s in preemption.SIGNALS} == before

    errors = []

    def in_a_thread():  # mgloop.run called from a library user's thread
        try:
            with preemption.StopOnSignal() as stop:
                assert not stop.requested
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert not errors
    assert {s: signal.getsignal(s) for s in preemption.SIGNALS} == before


def test_a_signal_to_one_worker_stops_every_worker_at_the_same_step(tmp_path):
    """Worker 1 (not the chief) is signalled: both agree on the step, the chief saves it."""
    process = subprocess.Popen(
        [sys.executable, "-m", "mgloop.launch", "--num_workers=2", "--devices_per_worker=cpu:1",
         "--", f"--logdir={tmp_path}", "--model=mlp", "--train_steps=100000",
         "--steps_per_loop=10", "--log_every=10", "--checkpoint_every=100000",
         "--collective_timeout=30"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    lines = read_all_until(process, "[worker 0]", "step 20/")
    pid = int(next(line for line in lines if "worker 1 at" in line).split("pid ")[1].rstrip(")\n"))
    os.kill(pid, signal.SIGTERM)
    output = "".join(lines) + process.communicate(timeout=300)[0]
    stops = [line for line in output.splitlines() if "stopped by SIGTERM after step" in line]
    assert len(stops) == 2, output[-3000:]  # one line per worker, the same step
    steps = {line.split("after step ")[1].split()[0] for line in stops}
    assert len(steps) == 1, stops
    step = int(steps.pop())
    assert tf.train.latest_checkpoint(str(tmp_path / "checkpoints")).endswith(f"ckpt-{step}")
    with open(tmp_path / "summary.json") as handle:
        assert json.load(handle)["preempted"] == {"signal": "SIGTERM", "step": step}
    assert "Traceback" not in output


def read_all_until(process, *texts) -> list[str]:
    """stdout lines up to the first holding every one of `texts`."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if all(text in line for text in texts):
            break
    return lines
