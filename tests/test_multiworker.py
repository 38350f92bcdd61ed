"""Several processes on TensorFlow's runtime: TF_CONFIG, gRPC, collective ops, on loopback.

Each test starts real worker processes through `python -m mgloop.launch`.

The long run's job (half a minute of training, then a frozen worker) is started in the
background when the module's first test starts and runs its steps on time in a thread
(`long_run`), its workers at a lower CPU priority once training, so its half minute passes
while the other tests' jobs run; its test, last, checks what the thread saw. The module's
tests run in one process (--dist loadgroup, setup.cfg): `straight` and the long run are
each started once.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import mgloop
from mgloop.cluster import peer_health
from mgloop.runs import export
from tests import helpers
from tests import tolerance

SETTINGS = ["--model=mlp", "--mlp_depth=1", "--global_batch_size=512", "--steps_per_loop=10",
            "--log_every=10", "--checkpoint_every=10", "--summary_every=0", "--deterministic",
            "--seed=3",
            "--learning_rate=0.05", "--collective_timeout=30", "--aggregation=ring"]
STEPS = 60

pytestmark = pytest.mark.xdist_group("multiworker")


def launcher(logdir, export_dir, *extra, launch_flags=()):
    return subprocess.Popen(
        [sys.executable, "-m", "mgloop.launch", "--num_workers=2", "--devices_per_worker=cpu:2",
         *launch_flags, "--", f"--logdir={logdir}", f"--export_dir={export_dir}",
         f"--train_steps={STEPS}", *SETTINGS, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"})


class Output:
    """A launcher's output lines, read by a thread: `wait_for` one while the run goes on."""

    def __init__(self, process):
        self.lines, self._changed = [], threading.Condition()
        threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process):
        for line in process.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()

    def wait_for(self, pattern, timeout):
        """The first match of `pattern` in a line, waiting up to `timeout` s; None if none."""
        def found():
            return next((m for m in map(re.compile(pattern).search, self.lines) if m), None)
        with self._changed:
            self._changed.wait_for(found, timeout)
            return found()

    def pids(self):
        return {int(m.group(1)): int(m.group(2)) for m in (
            re.match(r"\[launch\] worker (\d) .*\(pid (\d+)\)", line) for line in self.lines)
            if m}

    @property
    def text(self):
        with self._changed:
            return "".join(self.lines)


def lower_priority(pid, niceness):
    """A running worker at a lower CPU priority: every thread's nice value and, where the
    kernel shares CPU time between sessions first (sched_autogroup; a worker has a session
    of its own, launch.py), its session's. A hint to the scheduler only: whatever cannot
    be set (no autogroups here, a thread or the worker ended) is left as it is."""
    with contextlib.suppress(OSError):
        for thread in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, int(thread), niceness)
    with contextlib.suppress(OSError), open(f"/proc/{pid}/autogroup", "w") as group:
        group.write(str(niceness))


def threads(pid):
    with open(f"/proc/{pid}/status") as status:
        return int(re.search(r"^Threads:\s+(\d+)", status.read(), re.M).group(1))


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def stop_all(process, pids):
    """Cleanup after a failed test: nothing of the run may outlive it."""
    for pid in pids:
        for signum in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
    if process.poll() is None:
        process.kill()
    process.wait()


def weights(export_dir):
    return keras.models.load_model(os.path.join(export_dir, export.EXPORT_FILENAME)
                                   ).get_weights()


LONG_RUN_TEST = "test_a_long_run_keeps_its_threads_and_a_frozen_worker_is_named"
LONG_RUN_TIMEOUT = 15  # the long run's --collective_timeout
LONG_RUN_NICENESS = 10
LONG_RUN_STEPS = 100  # steps between the two thread counts: twice the bound on new threads
NEW_THREADS_BOUND = LONG_RUN_STEPS // 2  # per worker, between the two counts
# the two thread counts, in seconds after worker 0's first step (the second waits on for
# LONG_RUN_STEPS steps after the first): the old code parked a thread per collective, so
# 100 steps showed it, however long they took (at the workers' lower priority, in the
# whole suite, 200 steps held the module's last test up to 45 s after its other tests)
FIRST_COUNT, SECOND_COUNT = 10, 30


def last_step(output):
    """The last step worker 0 has logged so far."""
    steps = re.findall(r"^\[worker 0\] .*step (\d+)/", output.text, re.M)
    return int(steps[-1]) if steps else None


def long_run_steps(process, output, seen):
    """The long run's steps, on time, in a thread: the workers' threads FIRST_COUNT and
    SECOND_COUNT s after worker 0's first step (or later, once LONG_RUN_STEPS more steps are
    logged), then worker 1 frozen with SIGSTOP and the job's end; what they saw goes into
    `seen`, for the test below."""
    try:
        if not output.wait_for(r"^\[worker 0\] .*step \d+/", timeout=300):
            return
        seen["pids"] = pids = output.pids()
        for pid in pids.values():  # from here on, they only need to keep training
            lower_priority(pid, LONG_RUN_NICENESS)
        began = time.monotonic()
        time.sleep(FIRST_COUNT)
        seen["first"] = {index: threads(pid) for index, pid in pids.items()}
        seen["step at first"] = last_step(output)
        time.sleep(max(0.0, began + SECOND_COUNT - time.monotonic()))
        # on a loaded machine (its lower priority) the window may hold fewer steps than the
        # test needs: it waits on for them, up to 300 s after the first step
        wanted = (seen["step at first"] or 0) + LONG_RUN_STEPS
        while (last_step(output) or 0) < wanted and time.monotonic() < began + 300:
            time.sleep(1)
        seen["second"] = {index: threads(pid) for index, pid in pids.items()}
        seen["step at second"] = last_step(output)
        os.kill(pids[1], signal.SIGSTOP)
        # (300 s, as the waits above: a guard against a hang, not the deadline under test)
        seen["named"] = output.wait_for(
            r"^\[launch\] worker 1 stopped answering \(process stopped", timeout=300)
        seen["exit code"] = process.wait(timeout=120)
        seen["alive after"] = [alive(pid) for pid in pids.values()]  # before a pid is reused
    except Exception as error:  # noqa: BLE001 (raised again by the test)
        seen["error"] = error


@pytest.fixture(scope="module", autouse=True)
def long_run(request, tmp_path_factory):
    """The long run's job and its steps' thread, started when the module's first test
    starts (if the long run's test is selected). Once training, its workers run at a lower
    CPU priority: they only need to keep training, so they take the CPU the other tests'
    jobs leave. After the module, whatever of it still runs is stopped."""
    if not any(item.name == LONG_RUN_TEST for item in request.session.items):
        yield None
        return
    root = tmp_path_factory.mktemp("long_run")
    process = launcher(root / "run", root / "export", "--train_steps=10000000",
                       "--log_every=100", "--checkpoint_every=100000",
                       f"--collective_timeout={LONG_RUN_TIMEOUT}")
    output, seen = Output(process), {}
    thread = threading.Thread(target=long_run_steps, args=(process, output, seen), daemon=True)
    thread.start()
    yield process, output, thread, seen
    if process.poll() is None:  # its test failed or did not run to the end
        stop_all(process, output.pids().values())
    thread.join(timeout=60)


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
    model = keras.models.load_model(tmp_path / "single_export" / export.EXPORT_FILENAME)
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
    pids, lines = {}, []
    for line in process.stdout:
        lines.append(line)
        started = re.match(r"\[launch\] worker (\d) .*\(pid (\d+)\)", line)
        if started:
            pids[int(started.group(1))] = int(started.group(2))
        if re.match(r"\[worker 0\] .*step 30/", line):
            break
    os.kill(pids[1], signal.SIGKILL)
    output, _ = process.communicate(timeout=300)  # a hang guard only
    output = "".join(lines) + output
    assert process.returncode != 0
    # worker 0 stopped by itself, within the launcher's grace after it saw worker 1 die
    # (not terminated by the launcher): measured by the launcher, not by this test's
    # clock, which load on a shared machine stretches
    assert "still running after" not in output, output[-3000:]
    assert "[launch] worker 1 was killed by signal SIGKILL" in output, output[-3000:]
    # found by its collective (the connection reset) or by the health checks' refusals, not
    # after the 30 s a check may go unanswered (peer_health.py: a process that ended)
    lost = re.search(r"\[worker 0\] mgloop.train: error: lost the other workers \((.*)\)",
                     output)
    assert lost and "answered no health check" not in lost.group(1), output[-3000:]
    assert os.path.exists(logdir / "checkpoints" / "checkpoint")  # the chief's, kept

    restart = launcher(logdir, tmp_path / "export")
    output, _ = restart.communicate(timeout=300)
    assert restart.returncode == 0, output[-3000:]
    resumed = re.search(r"resumed from .*ckpt-(\d+) at step (\d+)", output)
    assert resumed and int(resumed.group(2)) >= 30
    for a, b in zip(weights(tmp_path / "export"), weights(straight / "export")):
        np.testing.assert_array_equal(a, b)


def test_sigterm_to_the_launcher_leaves_no_worker(tmp_path):
    """The signal is forwarded to both workers; within --stop_seconds they are gone (saved
    and exited, or killed), and the launcher exits with 128 + 15."""
    process = launcher(tmp_path / "run", tmp_path / "export", "--train_steps=10000000",
                       launch_flags=["--stop_seconds=30"])
    output, passed = Output(process), False
    try:
        assert output.wait_for(r"^\[worker 0\] .*step \d+/", timeout=300), output.text[-3000:]
        pids = output.pids()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 128 + signal.SIGTERM
        assert "[launch] received SIGTERM: sent SIGTERM to every worker" in output.text
        assert not any(alive(pid) for pid in pids.values()), output.text[-3000:]
        passed = True
    finally:
        if not passed:
            stop_all(process, output.pids().values())


def test_a_long_run_keeps_its_threads_and_a_frozen_worker_is_named(long_run):
    """Half a minute of training grows no threads (each collective's timeout used to park
    one: thousands a minute, then SIGABRT); then worker 1 is frozen with SIGSTOP, worker 0's
    health checks give up on it within their stated window (peer_health.py: at most
    timeout + 2 * interval after its last answer, so after the freeze), and the launcher
    names worker 1. The job ran since the module's first test (`long_run`).

    The window is read from worker 0's own line (the seconds since worker 1's last
    answer), not from this process's wall clock: under load, worker 0's exit and the
    launcher's report may take longer, which says nothing of the health checks."""
    process, output, thread, seen = long_run
    timeout = LONG_RUN_TIMEOUT
    window = timeout + 2 * peer_health.PeerHealth(None, timeout).interval  # 22.5 s
    thread.join(timeout=900)  # (a guard: the thread's own waits are bounded)
    assert not thread.is_alive(), output.text[-3000:]
    if "error" in seen:
        raise seen["error"]
    assert "pids" in seen, output.text[-3000:]  # worker 0 logged a step
    for index in seen["pids"]:
        assert seen["second"][index] - seen["first"][index] < NEW_THREADS_BOUND, (
            index, seen["first"], seen["second"])
    # it trained all along, at its lower priority too: more steps (each at least one
    # collective, which used to park a thread) than the bound on new threads, twice over
    assert seen["step at second"] - seen["step at first"] >= LONG_RUN_STEPS, (
        seen["step at first"], seen["step at second"])
    assert seen["named"], output.text[-3000:]
    assert seen["exit code"] == 3
    lost = re.search(r"^\[worker 0\] mgloop.train: error: lost the other workers \(worker 1 "
                     r"at \S+ answered no health check for (\d+)s", output.text, re.M)
    assert lost, output.text[-3000:]
    # given up on between timeout and the window after worker 1's last answer, which came
    # before the freeze (the seconds are printed rounded: 23 is up to 23.5)
    assert timeout <= int(lost.group(1)) <= window + 0.5, (lost.group(0), window)
    assert not any(seen["alive after"])  # the frozen one was killed
