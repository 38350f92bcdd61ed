"""Several processes: a dead, stopped or hung peer is found by health checks, not by timeouts.

The collectives between workers carry no timeout (a timeout parks one runtime
thread per collective for its whole length: at hundreds of collectives a
second a process reaches its thread limit and aborts). Instead, as
MultiWorkerMirroredStrategy does, one thread per worker (`PeerHealth`) asks
every other worker's gRPC server for its status every `interval` seconds
(`check_collective_ops_peer_health`, one RPC bounded by `interval`). A peer
that has answered no check for `timeout` seconds (a killed process, one
stopped by SIGSTOP, a hung machine or network) is declared lost: this
worker's collectives are aborted (`abort_collective_ops`), so the collective
the training loop waits in, and every later one, raises UnavailableError
whose message names the peer (`lost_peer_message`; mgloop.train prints it in
its one line, and mgloop.launch reads it there to name the failed worker).
A peer is so declared between `timeout` and `timeout + 2 * interval` seconds
after its last answer (one silent peer; each further one adds an interval to a
round of checks), with interval = min(5, max(0.5, timeout / 4)): at most 40 s
at the default 30.

A peer under load still answers: the status RPC is served by its gRPC
threads, not by its training loop.

A peer whose process has ended is found sooner: its server then refuses the
check's connection (or resets the open one) at once, where a stopped, hung or
cut-off peer lets the check run to its deadline. The checks start once every
peer's address has accepted a connection (`workers.wait_for_peers`, before any
collective), so a peer that refuses `GONE_CHECKS` checks in a row, `RECHECK`
seconds apart, has ended and is declared gone (`gone_peer_message`): at most
interval + RECHECK seconds after its end (6 s at the default timeout), where the
collective itself may wait out the whole timeout (its next connection to the
dead address is retried: 40 s after a SIGKILL, with two workers on one loaded
machine). Only a listening socket's absence refuses a connection: a live server
never does, and a link that is down or cut gives no answer, not a refusal.
"""

from __future__ import annotations

import re
import threading
import time

from absl import logging

from mgloop.cluster.workers import Cluster

# mgloop.train's exit code when it lost a peer; its one line names the peer when the
# health checks found it (`lost_peer_message`), which mgloop.launch reads to blame it.
LOST_PEERS_EXIT_CODE = 3
_LOST = re.compile(r"worker (\d+) at \S+ (?:answered no health check for \d+s "
                   r"\(stopped, hung or gone\)|refused \d+ health checks in a row "
                   r"\(its process ended\))")
GONE_CHECKS = 2  # refused checks in a row that declare a peer gone (its process ended)
RECHECK = 1.0  # seconds to the next round of checks after a refusal
# what gRPC says of a connection to an address where nothing listens (any more)
_REFUSED = ("Connection refused", "Connection reset by peer")


def lost_peer_message(index: int, address: str, seconds: float) -> str:
    """The words that name the lost peer (what `find_lost_peer` finds in an error)."""
    return f"worker {index} at {address} answered no health check for {seconds:.0f}s " \
           "(stopped, hung or gone)"


def gone_peer_message(index: int, address: str, refusals: int) -> str:
    """The words that name a peer whose server refuses connections: its process ended."""
    return f"worker {index} at {address} refused {refusals} health checks in a row " \
           "(its process ended)"


def refused(error: Exception) -> bool:
    """Whether a failed check's error is a refused or reset connection (nothing listens)."""
    return any(words in str(error) for words in _REFUSED)


def find_lost_peer(text: str) -> tuple[int, str] | None:
    """(index, message) of the `lost_peer_message` in `text` (an error, a log line), or None."""
    found = _LOST.search(text)
    return (int(found.group(1)), found.group(0)) if found else None


class PeerHealth:
    """Checks this worker's peers from a daemon thread, from `start()` to `stop()` (or the end
    of a `with` block)."""

    def __init__(self, cluster: Cluster, timeout: float):
        self.cluster = cluster
        self.timeout = timeout
        self.interval = min(5.0, max(0.5, timeout / 4))
        self.lost: str | None = None  # the lost peer's message, once aborted
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mgloop-peer-health",
                                        daemon=True)

    def start(self) -> None:
        if self._thread.ident is None and not self._stop.is_set():  # not started yet
            self._thread.start()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc_info):
        self.stop()

    def stop(self) -> None:
        """No more collectives between workers: stop checking (a peer may now exit)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        from tensorflow.python.eager import context
        import tensorflow as tf

        peers = [i for i in range(self.cluster.num_workers) if i != self.cluster.index]
        last_answer = {index: time.monotonic() for index in peers}
        refusals = dict.fromkeys(peers, 0)  # refused checks in a row
        wait = self.interval
        while not self._stop.wait(wait):
            wait = self.interval
            for index in peers:
                try:
                    context.context().check_collective_ops_peer_health(
                        self.cluster.task(index), timeout_in_ms=int(self.interval * 1000))
                    last_answer[index], refusals[index] = time.monotonic(), 0
                except tf.errors.OpError as error:
                    if self._stop.is_set():
                        continue
                    address = self.cluster.workers[index]
                    refusals[index] = refusals[index] + 1 if refused(error) else 0
                    silent = time.monotonic() - last_answer[index]
                    if refusals[index] >= GONE_CHECKS:
                        self.lost = gone_peer_message(index, address, refusals[index])
                    elif silent >= self.timeout:
                        self.lost = lost_peer_message(index, address, silent)
                    else:
                        if refusals[index]:  # ended, perhaps: the next round comes sooner
                            wait = min(wait, RECHECK)
                        continue
                    logging.error("%s; last check: %s; aborting this worker's collectives",
                                  self.lost, type(error).__name__)
                    context.context().abort_collective_ops(tf.errors.UNAVAILABLE, self.lost)
                    return


class _NoPeers:
    """One process: nothing to check."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        pass

    def stop(self) -> None:
        pass


def watch(cluster: Cluster | None, timeout: float):
    """Starts checking the peers of `cluster` (a no-op for one process); stop with `.stop()`
    or by leaving a `with` block."""
    if cluster is None or cluster.num_workers == 1:
        return _NoPeers()
    health = PeerHealth(cluster, timeout)
    health.start()
    return health
