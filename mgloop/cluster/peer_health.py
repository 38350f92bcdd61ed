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
threads, not by its training loop. A killed peer is usually noticed sooner,
by the collective itself (its connection closes).
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
_LOST = re.compile(r"worker (\d+) at \S+ answered no health check for \d+s "
                   r"\(stopped, hung or gone\)")


def lost_peer_message(index: int, address: str, seconds: float) -> str:
    """The words that name the lost peer (what `find_lost_peer` finds in an error)."""
    return f"worker {index} at {address} answered no health check for {seconds:.0f}s " \
           "(stopped, hung or gone)"


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
        while not self._stop.wait(self.interval):
            for index in peers:
                try:
                    context.context().check_collective_ops_peer_health(
                        self.cluster.task(index), timeout_in_ms=int(self.interval * 1000))
                    last_answer[index] = time.monotonic()
                except tf.errors.OpError as error:
                    silent = time.monotonic() - last_answer[index]
                    if silent < self.timeout or self._stop.is_set():
                        continue
                    self.lost = lost_peer_message(index, self.cluster.workers[index], silent)
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
