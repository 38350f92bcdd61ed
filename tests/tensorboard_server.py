"""A real `tensorboard` server on a free loopback port, read through its HTTP data API."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TensorBoard:
    def __init__(self, base_url: str):
        self.base_url = base_url

    def get(self, path: str, **params):
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.base_url}{path}{query}", timeout=10) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict):
        request = urllib.request.Request(f"{self.base_url}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def wait_for(self, predicate, path: str, timeout: float = 90.0, body: dict | None = None,
                 **params):
        """Polls `path` (a POST of `body` if given) until predicate(json) holds (TensorBoard
        loads event files lazily)."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            try:
                last = self.get(path, **params) if body is None else self.post(path, body)
                if predicate(last):
                    return last
            except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"TensorBoard never satisfied the check on {path}: last answer {last}")

    def scalars(self, run: str, tag: str) -> list[tuple[float, int, float]]:
        return self.get("/data/plugin/scalars/scalars", run=run, tag=tag)


# `tensorboard` as its console script runs it, with TensorFlow loaded first as mgloop's entry
# points load it (`quiet_start.load_tensorflow`: Keras's display-only imports held back),
# nothing else changed: 3 starts took 15.0 s of CPU as `python -m tensorboard.main`, 11.2 s so
SERVER = ("import sys\n"
          "from mgloop.runs import quiet_start\n"
          "quiet_start.load_tensorflow()\n"
          "from tensorboard.main import run_main\n"
          "sys.argv[0] = 'tensorboard'\n"
          "run_main()\n")


@contextlib.contextmanager
def serve(logdir: str):
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER, f"--logdir={logdir}", "--host=127.0.0.1",
         f"--port={port}", "--load_fast=false", "--reload_interval=1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        board = TensorBoard(f"http://127.0.0.1:{port}")
        board.wait_for(lambda runs: isinstance(runs, list), "/data/runs")
        yield board
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
