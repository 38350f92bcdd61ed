"""Elastic jobs: `python -m mgloop.launch --elastic --min_workers=M` restarts from a failure.

Restart-based elasticity, as torchrun's elastic agent and Horovod Elastic: the job runs in
rounds, each a set of W worker processes that resume from the last complete checkpoint
in --logdir (runs/node_checkpoint.py re-deals the nodes' state when W changed):

- a worker ends with a failure (killed, crashed; not a refusal, exit code 2): the others
  are killed at once (their collectives wait for a peer that is gone; the last complete
  checkpoint is on disk, and an incomplete one is skipped), and the next round starts
  with W - 1 workers, from the last checkpoint, without a person. Each such restart
  counts against --max_restarts (torchrun's); past it, or below --min_workers live
  slots, the launcher waits for a replacement (below the minimum) or exits with the
  failure's code (past the restarts);
- the failed slot's replacement is started at the next restart after it is due: once the
  running round has run --rejoin_seconds AND written a checkpoint newer than the one it
  started from (so every round advances), the launcher sends SIGTERM to every worker,
  which agree on a step, save its checkpoint and exit (runs/preemption.py), and the next
  round starts with one more worker. These membership restarts count against nothing;
- the round whose workers all exit 0 ends the job; a signal to the launcher is forwarded
  as in a plain job and ends it.

Rounds use fresh ports; worker indices are 0..W-1 in every round (worker 0 the chief), so
a node index denotes a slot of the round, not a process: node w's state is the one node w
of the checkpoint saved. The global batch follows the train flags (docs/multi-worker.md):
`--global_batch_size` keeps it at every W (each worker's share grows as workers leave),
`--batch_size_per_tower` keeps each tower's, so the global batch scales with W.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time
from typing import Callable

from mgloop.cluster.worker_processes import FORWARDED, Workers, is_stopped

_POLL_SECONDS = 0.2
_INDEX = re.compile(r"ckpt-(\d+)\.index")
REFUSED_EXIT_CODE = 2  # mgloop.train's exit code for a refused setting: never retried


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
    min_workers: int  # fewer live slots: wait for a replacement
    max_restarts: int  # restarts after failures (membership restarts are not counted)
    rejoin_seconds: float  # a failed slot's replacement joins after the round ran this long
    logdir: str  # the run's --logdir (its checkpoints say whether a round advanced)


def refusal(options: ElasticOptions, num_workers: int, train_flags: list[str],
            towers_per_worker: int | None) -> str | None:
    """The one line that refuses the elastic settings, or None."""
    if not 1 <= options.min_workers <= num_workers:
        return (f"--min_workers={options.min_workers} is out of range: must be 1.."
                f"{num_workers} (--num_workers)")
    if options.max_restarts < 0:
        return f"--max_restarts={options.max_restarts} is out of range: must be >= 0"
    if not options.rejoin_seconds >= 0:
        return f"--rejoin_seconds={options.rejoin_seconds} is out of range: must be >= 0"
    if not options.logdir:
        return ("--elastic needs --logdir=DIR after --: each round of workers resumes from "
                "the checkpoints in it")
    batch = flag_value(train_flags, "global_batch_size")
    if flag_value(train_flags, "batch_size_per_tower") is None and towers_per_worker:
        global_batch = int(batch) if batch and batch.isdigit() else 128  # Config's default
        for count in range(options.min_workers, num_workers + 1):
            if global_batch % (count * towers_per_worker):
                return (f"--global_batch_size={global_batch} does not split over {count} "
                        f"workers of {towers_per_worker} towers (an elastic job runs with "
                        f"{options.min_workers}..{num_workers}); give a multiple of every "
                        "such tower count, or --batch_size_per_tower (the global batch then "
                        "scales with the workers)")
    return None


def flag_value(train_flags: list[str], name: str) -> str | None:
    """The value of `--name=VALUE` among the train flags (the last one), or None."""
    values = [f.split("=", 1)[1] for f in train_flags if f.startswith(f"--{name}=")]
    return values[-1] if values else None


def newest_checkpoint(logdir: str) -> int:
    """The step of the newest checkpoint in `<logdir>/checkpoints` (-1: none)."""
    folder = os.path.join(logdir, "checkpoints")
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return max((int(m.group(1)) for m in map(_INDEX.fullmatch, names) if m), default=-1)


def run(start: Callable[[int], Workers], num_workers: int, options: ElasticOptions,
        received: list[int], stop_seconds: float, say: Callable[[str], None],
        current: list) -> int:
    """Runs rounds (module docstring) until one ends cleanly; returns 0, the failure's
    exit code past --max_restarts, or 128 + the signal that stopped the launcher.
    `start(W)` starts a round of W workers; `current[0]` holds the running round's
    Workers (for the launcher's signal handler)."""
    live, restarts, waiting = num_workers, 0, 0  # waiting: failed slots to replace
    while True:
        while live < options.min_workers:  # below the minimum: the replacements first
            say(f"{live} live worker(s), fewer than --min_workers={options.min_workers}: "
                f"starting a replacement")
            live, waiting = live + 1, waiting - 1
        since, round_start = newest_checkpoint(options.logdir), time.monotonic()
        say(f"round of {live} worker(s) from the checkpoint of step {max(since, 0)}"
            + (f" ({waiting} slot(s) to rejoin)" if waiting else ""))
        workers = start(live)  # also current[0], for the signal handler
        outcome, code = _watch(workers, received, stop_seconds, say, options, since,
                               round_start, waiting)
        workers.finish()
        current[0] = None
        if outcome == "done":
            return 0
        if outcome == "signal":
            return 128 + received[0]
        if outcome == "rejoin":
            live, waiting = live + 1, waiting - 1
            continue
        if code == REFUSED_EXIT_CODE:
            say("a worker refused its settings (exit code 2): not restarted")
            return code
        restarts += 1
        if restarts > options.max_restarts:
            say(f"restart {restarts} would pass --max_restarts={options.max_restarts}: the "
                "job stops; rerun the same command to resume from the last checkpoint")
            return code
        live, waiting = live - 1, waiting + 1
        say(f"restart {restarts} of {options.max_restarts}: continuing with {live} "
            "worker(s) from the last complete checkpoint")


def _watch(workers: Workers, received: list[int], stop_seconds: float, say, options,
           since: int, round_start: float, waiting: int) -> tuple[str, int]:
    """Watches one round: ("done", 0) all ended cleanly, ("failed", code) a worker failed
    (the others are killed), ("rejoin", 0) the round stopped to take a slot back, or
    ("signal", 0) the launcher was signalled and the workers have ended."""
    stopping, deadline = None, None  # "signal" or "rejoin", once SIGTERM went out
    while workers.running():
        now = time.monotonic()
        if received and stopping != "signal":
            signum = received[0]
            say(f"received {signal.Signals(signum).name}: sent "
                f"{signal.Signals(FORWARDED[signum]).name} to every worker; waiting up to "
                f"{stop_seconds:.0f}s for them to save and exit")
            stopping, deadline = "signal", now + stop_seconds
        failed = workers.first_failure()
        if failed is not None and stopping is None:
            say(f"{workers.blame(*failed)}; the other workers are stopped")
            workers.kill(workers.running())
            workers.running()
            return "failed", failed[1] if failed[1] > 0 else 128 - failed[1]
        if (stopping is None and waiting and now - round_start >= options.rejoin_seconds
                and newest_checkpoint(options.logdir) > since):
            say(f"a replacement is ready to join: sent SIGTERM to every worker, which save "
                f"a checkpoint and exit (up to {stop_seconds:.0f}s)")
            workers.forward(signal.SIGTERM)
            stopping, deadline = "rejoin", now + stop_seconds
        if stopping is not None:
            workers.kill([i for i in workers.running() if is_stopped(workers.processes[i].pid)])
            if now >= deadline:
                say(f"worker(s) {', '.join(map(str, workers.running()))} still running: "
                    "killed")
                workers.kill(workers.running())
        time.sleep(_POLL_SECONDS)
    if stopping == "signal":
        return "signal", 0
    failed = workers.first_failure()
    if failed is None:
        return "done", 0
    if stopping == "rejoin" and all(p.returncode in (0, 128 + signal.SIGTERM)
                                    for p in workers.processes):
        return "rejoin", 0
    return "failed", failed[1] if failed[1] > 0 else 128 - failed[1]
