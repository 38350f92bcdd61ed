"""One run per logdir: the chief holds `<logdir>/mgloop.lock` while it runs.

The lock is created with O_CREAT | O_EXCL (atomic on a local filesystem: of two runs
started together exactly one creates it) and holds JSON {pid, host, started,
process_start}: the holder's PID, host name, start time (UTC) and, on Linux, the
process's start time in clock ticks since boot (/proc/<pid>/stat field 22), which tells
a live holder from a new process that reuses its PID. A second run is refused with one
ConfigError line naming the holder's PID and host. A lock whose holder is gone (same
host, no such process or another process under its PID) is taken over with one log
line; a lock of another host is never taken over (its process cannot be checked from
here). The lock is removed when the run ends, whatever the way, a second signal's
exit at once included (preemption.py calls `release_held` first); a kill -9 leaves it,
and the next run takes it over as stale.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket

from absl import logging

from mgloop.errors import ConfigError

LOCK_FILENAME = "mgloop.lock"
_held: set[str] = set()  # the locks this process holds (release_held)


def _process_start(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (Linux), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    """Whether the process that wrote `holder` still runs (on this host)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    started = holder.get("process_start")
    return started is None or _process_start(pid) in (None, started)


def _read(path: str) -> dict:
    try:
        with open(path) as handle:
            holder = json.load(handle)
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}  # half-written or damaged: judged by what it holds, i.e. stale


def _create(path: str) -> bool:
    """Creates the lock with this process's record; False if it exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"),
              "process_start": _process_start(os.getpid())}
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle)
    return True


def acquire(logdir: str) -> str:
    """Takes `<logdir>/mgloop.lock` (taking over a stale one); returns its path.

    Raises ConfigError naming the holder if another live run holds it."""
    path = os.path.join(logdir, LOCK_FILENAME)
    for _ in range(3):  # a takeover can race another run's: try again, then refuse
        if _create(path):
            _held.add(path)
            return path
        holder = _read(path)
        host = holder.get("host")
        if holder and (host != socket.gethostname() or _alive(holder)):
            raise ConfigError(
                f"--logdir={logdir} is in use by another run (pid {holder.get('pid')} on "
                f"host {host}, started {holder.get('started')}; lock {path}): wait for it "
                "to end or use another --logdir")
        logging.warning("taking over the stale lock %s of pid %s on %s (that process is "
                        "gone)", path, holder.get("pid"), host)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    raise ConfigError(f"--logdir={logdir}: could not take the lock {path} (other runs keep "
                      "taking it); use another --logdir")


def release(path: str) -> None:
    """Removes the lock if this process still holds it."""
    _held.discard(path)
    if _read(path).get("pid") == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def release_held() -> None:
    """Removes every lock this process holds (before an exit that runs no `finally`)."""
    for path in list(_held):
        release(path)


@contextlib.contextmanager
def held(logdir: str, hold: bool = True):
    """Holds the lock of `logdir` for the body (if `hold`: the chief)."""
    path = acquire(logdir) if hold else None
    try:
        yield path
    finally:
        if path is not None:
            release(path)
