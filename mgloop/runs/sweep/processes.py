"""A sweep's cells in worker processes: each chunk of `cells_per_process` cells in a
fresh spawned process, `processes` at a time; signals forwarded, no worker outlives the
sweep.

Why processes: what TensorFlow keeps of a finished cell is freed only with its process
(runner.py). Python 3.11's ProcessPoolExecutor with max_tasks_per_child hung here after
its first replacement worker (a 36-cell sweep stopped at 17 records), hence plain
`multiprocessing` processes (spawned: a fork of a process that loaded TensorFlow is not
safe).

A worker (`_worker`) starts with SIGINT and SIGTERM blocked (the parent blocks them
around the spawn; the mask survives fork and exec), leaves the parent's process group (so
a terminal's Ctrl-C, sent to the foreground group, reaches the parent alone and a worker
gets each signal once, from the parent), loads TensorFlow as quietly as the parent did
(quiet_start.py: the parent passes whether; the variable it set is no user's), enters the
sweep's StopOnSignal and only then unblocks the signals: one that came while it was
starting stops it before its first cell. It exits with 128 + the signal number if a
signal stopped it, else 0.

The parent (`run`), on SIGINT or SIGTERM, starts no further worker, forwards the signal
to every running one and waits until all have exited: each stops its cell at the next
loop boundary with a checkpoint. A second signal is forwarded too, and a worker then
exits at once (preemption.py; its lock removed). Should the parent's own loop fail, it
sends SIGTERM to its workers and waits for them before the error goes on; should the
parent die without a word (SIGKILL), each worker sends itself SIGTERM (`_stop_with_parent`)
and stops as above.
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from typing import Callable

from mgloop.runs.sweep import plan as plan_lib

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _stop_with_parent() -> None:
    """A thread that sends this process SIGTERM once, should its parent die before it
    (SIGKILL: the parent waits for its workers otherwise): the cell then stops as for the
    parent's SIGTERM. It waits on multiprocessing's parent sentinel, which a parent's death
    makes readable. (Linux's PR_SET_PDEATHSIG is not used: every thread created after it
    sends the signal again, and a second signal means "at once".)"""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        multiprocessing.connection.wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=watch, daemon=True, name="mgloop-parent").start()


def chunks(cells: list, size: int) -> list[list]:
    """`cells` in consecutive runs of `size` (all in one for size 0)."""
    size = size or max(1, len(cells))
    return [cells[i:i + size] for i in range(0, len(cells), size)]


def _worker(plan: plan_lib.Plan, cells: list, towers: int, quiet: bool,
            run_chunk: Callable) -> None:
    os.setpgrp()  # signals come from the parent only (module docstring)
    _stop_with_parent()
    from mgloop.runs import collector, quiet_start
    quiet_start.load_tensorflow(quiet)
    collector.for_tracing()  # TensorFlow and Keras imported: the collector set for tracing
    from mgloop.runs import preemption
    with preemption.StopOnSignal(announce=False) as stop:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        run_chunk(plan, cells, towers, stop)
    if stop.signum is not None:
        sys.exit(128 + stop.signum)


def _forward(processes: list, signum: int) -> None:
    for process in processes:
        if process.exitcode is None:
            try:
                os.kill(process.pid, signum)
            except ProcessLookupError:
                pass


def run(plan: plan_lib.Plan, todo: list, towers: int, processes: int,
        cells_per_process: int, run_chunk: Callable) -> tuple[int | None, bool]:
    """Runs the chunks of `todo` in worker processes, each chunk by `run_chunk(plan, cells,
    towers, stop)` (a module's function, pickled by name: runner.py's, handed in so that
    this module does not import the runner that imports it); returns (the first signal
    that stopped the sweep or None, whether a second one came). A worker that fails does
    not stop the others: once every chunk has run, the cells left without a record are
    named in one error (the re-run runs just those)."""
    from mgloop.runs import quiet_start
    context = multiprocessing.get_context("spawn")
    # at most cells_per_process cells a process, and no fewer chunks than processes: a
    # round of the tuning search smaller than one chunk still uses every process
    share = math.ceil(len(todo) / processes)
    waiting = chunks(todo, min(cells_per_process or share, share))
    running: list = []
    failed: list[int] = []
    received: list[int] = []

    def on_signal(signum, frame):
        received.append(signum)
        _forward(running, signum)

    previous = {signum: signal.signal(signum, on_signal) for signum in SIGNALS}
    try:
        while running or (waiting and not received):
            while waiting and not received and len(running) < max(1, processes):
                signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
                try:
                    process = context.Process(target=_worker, args=(
                        plan, waiting.pop(0), towers, quiet_start.quiet(), run_chunk))
                    process.start()
                    running.append(process)
                finally:
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # may forward now
            running[0].join(timeout=1.0)
            for process in [p for p in running if p.exitcode is not None]:
                running.remove(process)
                if process.exitcode != 0:
                    failed.append(process.exitcode)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _forward(running, signal.SIGTERM)  # only if this loop failed: none is left running
        for process in running:
            process.join()
    if received:
        return received[0], len(received) > 1
    missing = [c.name for c in todo if not os.path.exists(plan.result_path(c))]
    if missing:
        raise RuntimeError(f"{len(missing)} cells have no record (sweep processes ended with "
                           f"exit codes {failed or 'none'}; their logs above say why): "
                           f"{', '.join(missing)}; re-run the same command to run them")
    return None, False
