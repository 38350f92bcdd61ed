"""The local worker processes of a job: started in their own process groups, watched,
signalled and named when one fails (mgloop/launch.py, cluster/elastic.py). Imports no
TensorFlow.

Each worker gets TF_CONFIG naming every worker's loopback address and its own index, and
its output is streamed line by line with a `[worker i]` prefix; its last `error:` line is
kept, so that a survivor's lost-peer line (cluster/peer_health.py) can name the worker at
fault.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import threading

from mgloop.cluster import peer_health  # imports no TensorFlow

FORWARDED = {signal.SIGTERM: signal.SIGTERM, signal.SIGINT: signal.SIGINT,
             signal.SIGHUP: signal.SIGTERM}


EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10000  # below: well-known and registered services


def _ephemeral() -> tuple[int, int]:
    """The kernel's range for ports it hands out itself (bind to 0, a client's connect)."""
    try:
        with open(EPHEMERAL_RANGE) as handle:
            low, high = map(int, handle.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_ports(count: int, rng: random.Random | None = None) -> list[int]:
    """`count` distinct ports that are free on 127.0.0.1 now, outside the kernel's ephemeral
    range: a port the kernel hands out (bind to 0) is free when chosen but may be taken by
    any client's connect (another job's gRPC channel) before the worker listens on it; a
    port outside that range is taken only by an explicit bind (tried here at random among
    the ports from LOWEST_PORT up to the range, then above it, until `count` bind)."""
    rng = rng or random.Random()
    low, high = _ephemeral()
    candidates = list(range(LOWEST_PORT, low)) + list(range(high + 1, 65536))
    rng.shuffle(candidates)
    ports: list[int] = []
    for port in candidates:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise OSError(f"no {count} free ports on 127.0.0.1 outside the ephemeral range "
                  f"{low}-{high}")


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


def signal_group(process: subprocess.Popen, signum: int) -> None:
    """Sends `signum` to the process group of `process` (started as its leader; call only
    while `process` is not reaped, so that the group's number is still its own)."""
    try:
        os.killpg(process.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def say(out, text: str) -> None:
    """One line of the launcher's own: `[launch] text`."""
    out.write(f"[launch] {text}\n")
    out.flush()


class Workers:
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
        with self.lock:  # not inside a worker's line
            say(self.out, text)

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
                signal_group(process, signal.SIGKILL)
                process.wait()
        return [i for i, p in enumerate(self.processes) if p.returncode is None]

    def first_failure(self) -> tuple[int, int] | None:
        """(index, exit code) of the failure to blame, None if no worker failed. Several
        workers can end between two polls, and a worker killed by a signal takes its peers
        down after it (their collectives fail: exit code 3, peer_health.py): a worker killed
        by a signal first, then one that exited with another error, a lost peer's exit
        last; the lowest index among equals."""
        self.running()
        failed = [(i, p.returncode) for i, p in enumerate(self.processes)
                  if p.returncode not in (None, 0)]
        return min(failed, default=None, key=lambda f: (
            f[1] > 0, f[1] == peer_health.LOST_PEERS_EXIT_CODE, f[0]))

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
            signal_group(self.processes[index], signal.SIGKILL)

    def finish(self) -> None:
        """Kills whatever is left of every worker's process group; waits for the streams."""
        for process in self.processes:
            if process.returncode is None:  # not reaped: its group's number is still its own
                signal_group(process, signal.SIGKILL)
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
