"""`python -m mgloop.launch --num_workers=N [--devices_per_worker=cpu:2] -- <train flags>`.

Starts N local `mgloop.train` worker processes on free loopback ports, each with
its own TF_CONFIG and in its own process group, and streams their output line by
line with a `[worker i]` prefix. The train flags after `--` reach every worker as
given, `--plugin=MODULE` included: each worker imports the module (from the
launcher's working directory and Python path) before it validates its settings.

When a worker fails, the launcher names the worker at fault: the one that ended,
or, when a survivor ended with exit code 3 naming a peer that answered no health
check (mgloop/cluster/peer_health.py), that peer, adding whether its process is stopped
(SIGSTOP). The others then stop by themselves (their collectives fail, or their
health checks give up after --collective_timeout) or are terminated after
--grace_seconds; a stopped worker is killed at once. The launcher exits with
the first failure's code.

SIGTERM, SIGINT or SIGHUP to the launcher is forwarded to every worker (SIGHUP as
SIGTERM), which may then save a checkpoint and exit; workers still running after
--stop_seconds, or at a second signal, are killed with their process groups. The
launcher then exits with 128 + the signal's number (143 for SIGTERM, 130 for
SIGINT), as a shell reports a process ended by it. For a real cluster, set
TF_CONFIG on each host and run `python -m mgloop.train` there (docs/multi-worker.md).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags

from mgloop import errors  # imports no TensorFlow
from mgloop.cluster import peer_health  # imports no TensorFlow

_FLAGS = flags.FLAGS
flags.DEFINE_integer("num_workers", 2, "worker processes to start on this machine")
flags.DEFINE_string("devices_per_worker", "cpu:2", "--devices of every worker")
flags.DEFINE_float("grace_seconds", 60.0,
                   "after a worker fails, how long the others get to stop by themselves "
                   "(their collectives fail or their health checks give up) before they are "
                   "terminated")
flags.DEFINE_float("stop_seconds", 60.0,
                   "after SIGTERM/SIGINT/SIGHUP (forwarded to every worker), how long the "
                   "workers get to save and exit before they are killed")

FORWARDED = {signal.SIGTERM: signal.SIGTERM, signal.SIGINT: signal.SIGINT,
             signal.SIGHUP: signal.SIGTERM}
_POLL_SECONDS = 0.2


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def tf_config(addresses: list[str], index: int) -> str:
    return json.dumps({"cluster": {"worker": addresses},
                       "task": {"type": "worker", "index": index}})


def how_it_ended(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def is_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, SIGTSTP, a debugger): /proc state T or t."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _has_ended(pid: int) -> bool:
    """Whether child `pid` has ended, without reaping it (its pid stays reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    """Sends `signum` to the process group of `process` (started as its leader; call only
    while `process` is not reaped, so that the group's number is still its own)."""
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class _Workers:
    """The worker processes, their output streams and what their last error line said."""

    def __init__(self, commands: list[list[str]], envs: list[dict], addresses: list[str], out):
        self.out = out
        self.lock = threading.Lock()
        self.errors: dict[int, str] = {}  # worker index -> its last "error:" line
        self.processes, self._streams = [], []
        for index, (command, env) in enumerate(zip(commands, envs)):
            process = subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                bufsize=1, start_new_session=True)  # own group: signals only from here
            self.say(f"worker {index} at {addresses[index]} started (pid {process.pid})")
            thread = threading.Thread(target=self._stream, args=(index, process.stdout),
                                      daemon=True)
            thread.start()
            self.processes.append(process)
            self._streams.append(thread)

    def say(self, text: str) -> None:
        with self.lock:
            self.out.write(f"[launch] {text}\n")
            self.out.flush()

    def _stream(self, index: int, pipe) -> None:
        for line in iter(pipe.readline, ""):
            if "error:" in line:
                self.errors[index] = line
            with self.lock:
                self.out.write(f"[worker {index}] {line}")
                self.out.flush()

    def running(self) -> list[int]:
        """The workers still running, after reaping those that ended: what is left of an
        ended worker's group is killed first, while its unreaped process keeps the group's
        number from being reused by another process."""
        for process in self.processes:
            if process.returncode is None and _has_ended(process.pid):
                _signal_group(process, signal.SIGKILL)
                process.wait()
        return [i for i, p in enumerate(self.processes) if p.returncode is None]

    def first_failure(self) -> tuple[int, int] | None:
        self.running()
        return next(((i, p.returncode) for i, p in enumerate(self.processes)
                     if p.returncode not in (None, 0)), None)

    def forward(self, signum: int) -> None:
        """Sends `signum` to every worker not yet reaped (safe in a signal handler)."""
        for process in self.processes:
            if process.returncode is None:
                try:
                    os.kill(process.pid, signum)
                except ProcessLookupError:
                    pass

    def kill(self, indices) -> None:
        for index in indices:
            _signal_group(self.processes[index], signal.SIGKILL)

    def finish(self) -> None:
        """Kills whatever is left of every worker's process group; waits for the streams."""
        for process in self.processes:
            if process.returncode is None:  # not reaped: its group's number is still its own
                _signal_group(process, signal.SIGKILL)
                process.wait()
        for thread in self._streams:
            thread.join(timeout=5)

    def blame(self, index: int, code: int) -> str:
        """Which worker failed and how, for the first failure: worker `index` ended with
        `code`; a survivor's lost-peer line names the worker at fault instead."""
        culprit = None
        if code == peer_health.LOST_PEERS_EXIT_CODE:
            self._streams[index].join(timeout=5)  # its last line may still be in the pipe
            lost = peer_health.find_lost_peer(self.errors.get(index, ""))
            culprit = lost[0] if lost else None
        if culprit is None or culprit == index or culprit >= len(self.processes):
            return f"worker {index} {how_it_ended(code)}"
        process = self.processes[culprit]
        state = ("process stopped, by SIGSTOP?" if is_stopped(process.pid)
                 else "process still running" if culprit in self.running()
                 else how_it_ended(process.returncode).replace("was ", "", 1))
        return (f"worker {culprit} stopped answering ({state}); worker {index} "
                f"{how_it_ended(code)} after its health checks of worker {culprit} failed")


def launch(num_workers: int, devices: str, train_flags: list[str], grace: float,
           stop_seconds: float = 60.0, out=sys.stdout, command: list[str] | None = None) -> int:
    """Runs the workers to the end; returns 0, the first failure's exit code, or 128 + the
    number of the signal that stopped the launcher. `command` replaces
    `python -m mgloop.train` (tests)."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(num_workers)]
    command = command or [sys.executable, "-m", "mgloop.train"]
    received: list[int] = []
    workers = None

    def on_signal(signum, frame):
        received.append(signum)
        if workers is None:
            return
        if len(received) == 1:
            workers.forward(FORWARDED[signum])
        else:
            workers.kill(range(len(workers.processes)))

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, on_signal) for s in FORWARDED}
    try:
        workers = _Workers(
            [[*command, f"--devices={devices}", *train_flags]] * num_workers,
            [dict(os.environ, TF_CONFIG=tf_config(addresses, i)) for i in range(num_workers)],
            addresses, out)
        if received:  # a signal came while the workers were starting
            workers.forward(FORWARDED[received[0]])
        return _supervise(workers, received, grace, stop_seconds)
    finally:
        if workers is not None:
            workers.finish()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _supervise(workers: _Workers, received: list[int], grace: float,
               stop_seconds: float) -> int:
    """Watches the workers until every one has ended (see the module docstring)."""
    phase, deadline, failed = "running", None, None
    while workers.running():
        now = time.monotonic()
        if received and phase != "stopping":
            signum = received[0]
            workers.say(f"received {signal.Signals(signum).name}: sent "
                        f"{signal.Signals(FORWARDED[signum]).name} to every worker; waiting up "
                        f"to {stop_seconds:.0f}s for them to save and exit (a second signal "
                        "kills them)")
            phase, deadline = "stopping", now + stop_seconds
        elif phase == "running":
            failed = workers.first_failure()
            if failed is not None:
                workers.say(f"{workers.blame(*failed)}; waiting up to {grace:.0f}s for the "
                            "others to stop")
                phase, deadline = "failed", now + grace
        if phase != "running":  # a stopped worker would never end by itself
            workers.kill([i for i in workers.running() if is_stopped(workers.processes[i].pid)])
        if deadline is not None and now >= deadline:
            left = ", ".join(map(str, workers.running()))
            if phase == "failed":
                workers.say(f"worker(s) {left} still running after {grace:.0f}s: terminated")
                for index in workers.running():
                    _signal_group(workers.processes[index], signal.SIGTERM)
                phase, deadline = "terminating", now + 10.0
            else:
                workers.say(f"worker(s) {left} still running: killed")
                workers.kill(workers.running())
                break
        time.sleep(_POLL_SECONDS)
    if received:
        return 128 + received[0]
    failed = failed or workers.first_failure()
    if failed is None:
        return 0
    return failed[1] if failed[1] > 0 else 128 - failed[1]


def refusal(num_workers: int, grace: float, stop_seconds: float,
            train_flags: list[str]) -> str | None:
    """The one line that refuses the launcher's settings, or None: they can run."""
    if any(f.startswith("--devices=") or f == "--devices" for f in train_flags):
        return ("--devices is set per worker by the launcher: give --devices_per_worker="
                "DEVICES (e.g. cpu:2) instead of --devices after --")
    if num_workers < 1:
        return f"--num_workers={num_workers} is out of range: must be >= 1 (e.g. --num_workers=2)"
    for flag, value in (("grace_seconds", grace), ("stop_seconds", stop_seconds)):
        if not value >= 0:  # NaN too
            return f"--{flag}={value} is out of range: must be >= 0 seconds"
    return None


def main(argv):
    train_flags = argv[1:]
    problem = refusal(_FLAGS.num_workers, _FLAGS.grace_seconds, _FLAGS.stop_seconds,
                      train_flags)
    if problem:  # one line and exit code 2, as mgloop.train's refusals (no usage text)
        print(f"mgloop.launch: error: {problem}", file=sys.stderr)
        sys.exit(2)
    sys.exit(launch(_FLAGS.num_workers, _FLAGS.devices_per_worker, train_flags,
                    _FLAGS.grace_seconds, _FLAGS.stop_seconds))


if __name__ == "__main__":
    app.run(main, flags_parser=errors.flags_parser("mgloop.launch"))
