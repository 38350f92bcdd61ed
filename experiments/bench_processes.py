"""The harness's worker processes: one per one-process system, W per multi-worker system.

A `Worker` is one experiments/bench_worker.py process, spoken to over its
stdin/stdout (protocol in bench_worker.py). A `System` is all the processes of
one benchmark system: one for a one-process system; for a multi-worker system
W processes on free loopback ports, worker i with TF_CONFIG
{"cluster": {"worker": [addresses]}, "task": {"type": "worker", "index": i}}
(mgloop.launch's format) and, with GPUs, its own GPUs w*T..w*T+T-1 through
CUDA_VISIBLE_DEVICES.

`System.ask(command)` sends the command to every process first, then waits
for every reply, so the W workers run one timed loop together (their
collectives need each other). The reply is the chief's (worker 0): the time of
a loop is the chief's wall-clock time of it (every step ends in a collective
across workers, so no worker finishes a loop much before the others); resident
set sizes are summed over the processes (the system's host memory); the build
time is the slowest worker's; `devices` lists every worker's devices, so the
split a system actually ran on is on record. When one process of a system
fails, waiting for another's reply stops within a second with the failed
process's log tail (a survivor would otherwise wait for its collectives).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading

from mgloop.launch import free_ports, tf_config

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SUMMED = ("baseline_rss_kib", "peak_rss_kib")


class Worker:
    """One bench_worker.py process; `ask` sends a command and waits for its reply."""

    def __init__(self, name: str, request: dict, log_path: str, env: dict | None = None):
        self.name = name
        self.log_path = log_path
        environ = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        environ.update(env or {})
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "experiments.bench_worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, text=True, env=environ, cwd=ROOT)
        self._replies = queue.Queue()  # parsed replies; None once stdout has ended
        threading.Thread(target=self._read, daemon=True).start()
        self.send(request)

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith("@@bench "):
                self._replies.put(json.loads(line[len("@@bench "):]))
        self._replies.put(None)

    def send(self, command) -> None:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def exited(self) -> RuntimeError:
        self.process.wait()
        with open(self.log_path) as handle:
            tail = handle.read()[-3000:]
        return RuntimeError(f"{self.name}: worker exited ({self.process.returncode}): {tail}")

    def receive(self, peers: list["Worker"] = ()) -> dict:
        """The next reply; raises if this worker ends first, or one of `peers` (the other
        processes of its system, whose collectives it may be waiting for) fails."""
        while True:
            try:
                reply = self._replies.get(timeout=1.0)
            except queue.Empty:
                for peer in peers:
                    if peer.process.poll() not in (None, 0):
                        raise peer.exited()
                continue
            if reply is None:
                raise self.exited()
            if "error" in reply:
                raise RuntimeError(f"{self.name}: {reply['error']}\n{reply['traceback']}")
            return reply

    def ask(self, command) -> dict:
        self.send(command)
        return self.receive()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._log.close()


class System:
    """The process(es) of one system, started at once; `receive()` the ready reply next."""

    def __init__(self, name: str, spec: dict, workers: int, logical_devices: int,
                 log_stem: str, device_kind: str = "cpu"):
        self.name = name
        request = {"spec": spec, "logical_devices": logical_devices}
        envs = [{}]
        if workers > 1:
            addresses = [f"127.0.0.1:{port}" for port in free_ports(workers)]
            envs = [{"TF_CONFIG": tf_config(addresses, index)} for index in range(workers)]
            if device_kind == "gpu":
                towers = spec["towers"]
                for index, env in enumerate(envs):
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(
                        str(index * towers + t) for t in range(towers))
        self.workers = []
        try:
            for index, env in enumerate(envs):
                label = name if workers == 1 else f"{name} worker {index}"
                log = log_stem + ("" if workers == 1 else f"-worker{index}") + ".log"
                self.workers.append(Worker(label, request, log, env))
        except BaseException:
            self.close()
            raise

    def receive(self) -> dict:
        replies = [worker.receive([peer for peer in self.workers if peer is not worker])
                   for worker in self.workers]
        combined = dict(replies[0])
        for key in SUMMED:
            if key in combined:
                combined[key] = sum(reply[key] for reply in replies)
        if "build_seconds" in combined:
            combined["build_seconds"] = max(reply["build_seconds"] for reply in replies)
        if "devices" in combined:
            combined["devices"] = [reply["devices"] for reply in replies]
        return combined

    def ask(self, command) -> dict:
        for worker in self.workers:
            worker.send(command)
        return self.receive()

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
