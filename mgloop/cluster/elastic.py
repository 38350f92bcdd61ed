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
import json
import os
import re
import signal
import time
from typing import Callable

from absl import flags

from mgloop.cluster.worker_processes import FORWARDED, Workers, is_stopped

_POLL_SECONDS = 0.2
_INDEX = re.compile(r"ckpt-(\d+)\.index")
REFUSED_EXIT_CODE = 2  # mgloop.train's exit code for a refused setting: never retried
# the launcher's rounds so far, given to every worker of a round (runs/run_end.py reads it)
ROUNDS_VARIABLE = "MGLOOP_ELASTIC_ROUNDS"


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
    min_workers: int  # fewer live slots: wait for a replacement
    max_restarts: int  # restarts after failures (membership restarts are not counted)
    rejoin_seconds: float  # a failed slot's replacement joins after the round ran this long
    logdir: str  # the run's --logdir (its checkpoints say whether a round advanced)


def refusal(options: ElasticOptions, num_workers: int, train_flags: list[str],
            towers_per_worker: int | None, default_global_batch: int) -> str | None:
    """The one line that refuses the elastic settings, or None. `default_global_batch`: the
    run's global batch when the train flags set neither batch size (the data options'
    default, mgloop/data/options.py, given by the launcher: this package imports no
    other of mgloop's)."""
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
        global_batch = int(batch) if batch and batch.isdigit() else default_global_batch
        for count in range(options.min_workers, num_workers + 1):
            if global_batch % (count * towers_per_worker):
                return (f"--global_batch_size={global_batch} does not split over {count} "
                        f"workers of {towers_per_worker} towers (an elastic job runs with "
                        f"{options.min_workers}..{num_workers}); give a multiple of every "
                        "such tower count, or --batch_size_per_tower (the global batch then "
                        "scales with the workers)")
    return None


def flag_value(train_flags: list[str], name: str) -> str | None:
    """The value of flag `name` among the train flags as absl (mgloop.train) reads them, the
    last one given: `--name=VALUE`, `--name VALUE` (one dash too), inside `--flagfile`
    files (expanded by absl, nested ones too), up to a `--`; None when not given.
    A flagfile that cannot be read raises absl's flags.Error (its message names it)."""
    argv = flags.FlagValues().read_flags_from_files(list(train_flags))
    value = None
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg == "--":
            break
        bare = arg[2:] if arg.startswith("--") else arg[1:] if arg.startswith("-") else None
        if bare == name and index + 1 < len(argv):
            value, index = argv[index + 1], index + 1
        elif bare is not None and bare.startswith(f"{name}="):
            value = bare.split("=", 1)[1]
        index += 1
    return value


def newest_checkpoint(logdir: str) -> int:
    """The step of the newest checkpoint in `<logdir>/checkpoints` (-1: none)."""
    folder = os.path.join(logdir, "checkpoints")
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return max((int(m.group(1)) for m in map(_INDEX.fullmatch, names) if m), default=-1)


def run(start: Callable[[int, dict], Workers], num_workers: int, options: ElasticOptions,
        received: list[int], stop_seconds: float, say: Callable[[str], None],
        current: list) -> int:
    """Runs rounds (module docstring) until one ends cleanly; returns 0, the failure's
    exit code past --max_restarts, or 128 + the signal that stopped the launcher.
    `start(W, env)` starts a round of W workers with the variables `env` added to their
    environment; `current[0]` holds the running round's Workers (for the launcher's signal
    handler). Every round's workers get ROUNDS_VARIABLE: the rounds so far as the launcher
    saw them (`round_record`), which the last round's chief writes into summary.json."""
    live, restarts, waiting = num_workers, 0, 0  # waiting: failed slots to replace
    job, rounds = f"{os.getpid()}-{time.time_ns()}", []
    while True:
        since, round_start = newest_checkpoint(options.logdir), time.monotonic()
        say(f"round of {live} worker(s) from the checkpoint of step {max(since, 0)}"
            + (f" ({waiting} slot(s) to rejoin)" if waiting else ""))
        rounds.append(round_record(live, since, restarts))
        # also current[0], for the signal handler
        workers = start(live, {ROUNDS_VARIABLE: json.dumps({"job": job, "rounds": rounds})})
        outcome, code, why = _watch(workers, received, stop_seconds, say, options, since,
                                    round_start, waiting)
        rounds[-1]["ended"] = why
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
        live, waiting, line = after_failure(live, waiting, options, restarts)
        say(line)


def after_failure(live: int, waiting: int, options: ElasticOptions,
                  restarts: int) -> tuple[int, int, str]:
    """(workers, slots waiting to rejoin, what the launcher says) for the round after a
    failure in a round of `live` workers: one fewer, unless that is below --min_workers,
    when the failed slot's replacement starts at once (as torchrun restarts its group)."""
    head = f"restart {restarts} of {options.max_restarts}: "
    if live - 1 < options.min_workers:
        return live, waiting, (
            f"{head}{live - 1} worker(s) left, fewer than --min_workers={options.min_workers}:"
            f" a replacement starts at once; continuing with {live} worker(s) from the last "
            "complete checkpoint")
    return live - 1, waiting + 1, (
        f"{head}continuing with {live - 1} worker(s) from the last complete checkpoint; the "
        "failed slot rejoins later")


def round_record(workers: int, since: int, restarts: int) -> dict:
    """The launcher's record of a round as it starts: its workers, the step of the newest
    checkpoint it resumes from (0: none), the failures restarted from before it; "ended"
    is added when it ends (what `_watch` said)."""
    return {"workers": workers, "from_step": max(since, 0), "restarts": restarts}


def _watch(workers: Workers, received: list[int], stop_seconds: float, say, options,
           since: int, round_start: float, waiting: int) -> tuple[str, int, str]:
    """Watches one round: ("done", 0) all ended cleanly, ("failed", code) a worker failed
    (the others are killed), ("rejoin", 0) the round stopped to take a slot back, or
    ("signal", 0) the launcher was signalled and the workers have ended; third, why the
    round ended, in words (its record's "ended")."""
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
            blame = workers.blame(*failed)
            say(f"{blame}; the other workers are stopped")
            workers.kill(workers.running())
            workers.running()
            return "failed", failed[1] if failed[1] > 0 else 128 - failed[1], f"failed: {blame}"
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
        return "signal", 0, f"stopped: the launcher received {signal.Signals(received[0]).name}"
    failed = workers.first_failure()
    if failed is None:
        return "done", 0, "done: every worker exited 0"
    if stopping == "rejoin" and all(p.returncode in (0, 128 + signal.SIGTERM)
                                    for p in workers.processes):
        return "rejoin", 0, "rejoin: stopped to take a replacement back"
    blame = workers.blame(*failed)  # every worker ended between two polls
    say(f"{blame}; the other workers had ended")
    return "failed", failed[1] if failed[1] > 0 else 128 - failed[1], f"failed: {blame}"
