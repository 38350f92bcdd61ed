"""SIGTERM and SIGINT end a run at a loop boundary, after a checkpoint of that step.

As Keras's BackupAndRestore and TensorFlow's PreemptionCheckpointHandler: the first
SIGTERM or SIGINT only records the signal; `Controller.train` finishes the compiled loop
that is running, ends there, and writes the checkpoint of that step (the chief);
`experiment.run` writes summary.json with `"preempted": {"signal", "step"}` and logs
one line; `python -m mgloop.train` then exits with 128 + the signal number (143 for
SIGTERM, 130 for SIGINT). A second signal ends the process at once with 128 + its
number, even inside a compiled loop, leaving the last complete checkpoint (a
checkpoint is written under a temporary name and renamed, so never half of one).

Several workers must stop after the same step, or one would wait in a collective for
the others: after every loop each worker adds its flag (1 if signalled) to one sum over
workers (`CrossWorker.all_workers_sum`, compiled once), and all stop when the sum is
positive. A worker stopped by another's signal exits as for SIGTERM. One process pays
no collective.

Handlers are installed only on the main thread (Python delivers signals there; a
library user calling `mgloop.run` from another thread gets no handler) and the previous
handlers are put back when the run ends.

Nested: a StopOnSignal entered while another is active in the process (a sweep's, around
its cells' runs: mgloop/runs/sweep/) installs nothing and shares the outer one's signal,
so a signal that arrives between two runs, or in the last loop of one, is still seen by
the owner after that run ends; the owner says what stopped (`announce=False`: the
watcher logs nothing; `last_words(signum)` runs before a second signal's exit) and the
nested run logs its stop at DEBUG (`nested`).
Before a second signal ends the process, the logdir locks it holds are removed
(logdir_lock.release_held), so a hard stop leaves no lock either.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable

from absl import logging

from mgloop.runs import logdir_lock

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_active: list[StopOnSignal] = []  # the outermost StopOnSignal that installed handlers


class StopOnSignal:
    """Context manager: while active, SIGTERM/SIGINT set `signum` instead of ending the
    process (main thread only); a second one exits at once with 128 + its number.

    Python runs a signal handler only between bytecodes of the main thread, which may be
    inside a compiled loop for a long time; so the signals are counted by a small thread
    reading the handlers' wakeup pipe (`signal.set_wakeup_fd`), which sees them at once:
    the first is logged and recorded, the second ends the process (`os._exit`).
    """

    def __init__(self, announce: bool = True,
                 last_words: Callable[[int], None] | None = None):
        self.announce = announce  # log the signals as they come (False: the owner reports)
        self.last_words = last_words  # called with the second signal, before the exit
        self._signum: int | None = None
        self._outer: StopOnSignal | None = None
        self._previous: dict[int, object] = {}
        self._previous_wakeup = -1
        self._pipe: tuple[int, int] | None = None
        self._watcher: threading.Thread | None = None

    @property
    def signum(self) -> int | None:
        """The first signal received (None: none), the outer StopOnSignal's if nested."""
        return self._outer.signum if self._outer is not None else self._signum

    @signum.setter
    def signum(self, value: int | None) -> None:
        if self._outer is not None:
            self._outer.signum = value
        else:
            self._signum = value

    @property
    def nested(self) -> bool:
        """Whether an outer StopOnSignal owns the signals (and reports the stop)."""
        return self._outer is not None

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only: leave them to its owner
        if _active:
            self._outer = _active[0]
            return self
        _active.append(self)
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._pipe = (read, write)
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, _ignore)
        self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, args=(read,), daemon=True,
                                         name="mgloop-signals")
        self._watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._outer is not None:
            self._outer = None
            return
        if self._pipe is None:
            return
        _active.remove(self)
        signal.set_wakeup_fd(self._previous_wakeup)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        read, write = self._pipe
        os.close(write)  # the watcher reads end-of-file and returns
        self._watcher.join(timeout=5)
        os.close(read)
        self._pipe = self._watcher = None

    def _watch(self, read: int) -> None:
        while True:
            try:
                received = os.read(read, 64)
            except OSError:
                return
            if not received:
                return
            for signum in received:
                if signum not in SIGNALS:
                    continue
                name = signal.Signals(signum).name
                if self.signum is not None:
                    if self.announce:
                        logging.warning("received %s again: exiting at once", name)
                    logdir_lock.release_held()
                    if self.last_words is not None:
                        self.last_words(signum)
                    os._exit(128 + signum)
                self.signum = signum
                if self.announce:
                    logging.warning("received %s: finishing the current loop, then saving a "
                                    "checkpoint (a second signal exits at once)", name)

    @property
    def requested(self) -> bool:
        return self.signum is not None


def _ignore(signum, frame) -> None:
    """The Python-level handler: nothing; the watcher thread acts on the wakeup byte."""


def stop_check(stop: StopOnSignal, aggregation) -> Callable[[], bool]:
    """() -> whether to stop after this loop, the same answer on every worker.

    One process: this process's flag. Several workers (`aggregation.cluster`,
    cross_worker.py): the sum over workers of their 0/1 flags, > 0, computed by one
    compiled collective that every worker runs after every loop.
    """
    cluster = aggregation.cluster
    if cluster is None or cluster.num_workers <= 1:
        return lambda: stop.requested
    import numpy as np  # here: a sweep's worker imports this module before TensorFlow loads
    import tensorflow as tf
    summed = tf.function(aggregation.all_workers_sum, autograph=False,
                         input_signature=[tf.TensorSpec([], tf.float32)])
    flags = {False: np.zeros([], np.float32), True: np.ones([], np.float32)}

    def check() -> bool:
        agreed = float(summed(flags[stop.requested])) > 0
        if agreed and stop.signum is None:
            stop.signum = signal.SIGTERM  # stopped by another worker's signal
        return agreed
    return check
