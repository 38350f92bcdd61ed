"""One run per logdir (issue 13, item 5; mgloop/runs/logdir_lock.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

import mgloop
from mgloop.runs import logdir_lock
from mgloop.errors import ConfigError
from tests import helpers


def write_lock(logdir, pid):
    os.makedirs(logdir, exist_ok=True)
    with open(os.path.join(logdir, logdir_lock.LOCK_FILENAME), "w") as handle:
        json.dump({"pid": pid, "host": socket.gethostname(), "started": "earlier",
                   "process_start": logdir_lock._process_start(pid)}, handle)


def test_a_second_run_on_a_held_logdir_is_refused_naming_the_holder(logdir):
    holder = subprocess.Popen(["sleep", "600"])  # a live run on this host
    try:
        write_lock(logdir, holder.pid)
        with pytest.raises(ConfigError) as error:
            mgloop.run(helpers.small_config(logdir))
    finally:
        holder.kill()
        holder.wait()
    message = str(error.value)
    assert "\n" not in message
    assert f"pid {holder.pid}" in message and f"host {socket.gethostname()}" in message
    assert not os.path.exists(os.path.join(logdir, "checkpoints"))  # refused before training


def test_a_stale_lock_is_taken_over_and_the_lock_released_at_the_end(logdir, caplog):
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid no longer runs
    write_lock(logdir, gone.pid)
    with caplog.at_level("WARNING"):
        summary = mgloop.run(helpers.small_config(logdir))
    assert summary["final_step"] == 5
    assert any("taking over the stale lock" in r.getMessage() and str(gone.pid) in
               r.getMessage() for r in caplog.records)
    assert not os.path.exists(os.path.join(logdir, logdir_lock.LOCK_FILENAME))


def test_two_takers_of_one_logdir_exactly_one_holds(tmp_path):
    path = logdir_lock.acquire(str(tmp_path))  # this process holds it
    with pytest.raises(ConfigError, match=f"pid {os.getpid()} on host"):
        logdir_lock.acquire(str(tmp_path))
    logdir_lock.release(path)
    assert not os.path.exists(path)
