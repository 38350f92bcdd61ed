"""`python -m mgloop.launch --num_workers=N [--devices_per_worker=cpu:2] -- <train flags>`.

Starts N local `mgloop.train` worker processes on free loopback ports, each with
its own TF_CONFIG, streams their output line by line with a `[worker i]`
prefix, and exits with the first non-zero exit code after saying which worker failed
and how. The others then stop by themselves (their collectives time out after
--collective_timeout) or are terminated after --grace_seconds. For a real cluster, set TF_CONFIG
on each host and run `python -m mgloop.train` there (README).
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

_FLAGS = flags.FLAGS
flags.DEFINE_integer("num_workers", 2, "worker processes to start on this machine")
flags.DEFINE_string("devices_per_worker", "cpu:2", "--devices of every worker")
flags.DEFINE_float("grace_seconds", 60.0,
                   "after a failure, how long the others get to stop by themselves (their "
                   "collectives time out) before they are terminated")


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


def _stream(index: int, pipe, out, lock) -> None:
    for line in iter(pipe.readline, ""):
        with lock:
            out.write(f"[worker {index}] {line}")
            out.flush()


def launch(num_workers: int, devices: str, train_flags: list[str], grace: float,
           out=sys.stdout) -> int:
    """Runs the workers to the end; returns 0 or the first non-zero exit code."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(num_workers)]
    lock = threading.Lock()
    workers, streams = [], []
    for index in range(num_workers):
        env = dict(os.environ, TF_CONFIG=tf_config(addresses, index))
        process = subprocess.Popen(
            [sys.executable, "-m", "mgloop.train", f"--devices={devices}", *train_flags],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        with lock:
            out.write(f"[launch] worker {index} at {addresses[index]} started (pid "
                      f"{process.pid})\n")
            out.flush()
        thread = threading.Thread(target=_stream, args=(index, process.stdout, out, lock),
                                  daemon=True)
        thread.start()
        workers.append(process)
        streams.append(thread)
    failed = None
    while failed is None and any(p.poll() is None for p in workers):
        for index, process in enumerate(workers):
            code = process.poll()
            if code not in (None, 0):
                failed = (index, code)
                break
        time.sleep(0.2)
    if failed is None:
        failed = next(((i, p.returncode) for i, p in enumerate(workers) if p.returncode), None)
    if failed is not None:
        index, code = failed
        with lock:
            out.write(f"[launch] worker {index} {how_it_ended(code)}; waiting up to "
                      f"{grace:.0f}s for the others to stop\n")
            out.flush()
        deadline = time.monotonic() + grace
        for process in workers:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    for thread in streams:
        thread.join(timeout=5)
    if failed is None:
        return 0
    return failed[1] if failed[1] > 0 else 128 - failed[1]


def main(argv):
    train_flags = argv[1:]
    if any(f.startswith("--devices=") or f == "--devices" for f in train_flags):
        raise app.UsageError("set the workers' devices with --devices_per_worker, not --devices")
    if _FLAGS.num_workers < 1:
        raise app.UsageError(f"--num_workers={_FLAGS.num_workers}: needs at least 1")
    sys.exit(launch(_FLAGS.num_workers, _FLAGS.devices_per_worker, train_flags,
                    _FLAGS.grace_seconds))


if __name__ == "__main__":
    app.run(main)
