"""A cell's evals kept in its logdir, so that a stopped cell resumes from its checkpoint
and still records its whole curve.

A run resumed from a checkpoint at step S has in its History only the evals after S
(run_result.py). The sweep passes each cell's run a `Keeper` callback, which appends
every record {"step": s, **metrics} of a loop that evaluated to
`<logdir>/sweep_evals.jsonl`, one JSON line each (floats as repr: read back exactly) and
flushed at once, in every attempt. The cell's record takes its curve from the file
(`history`): the evals before S from the attempts before, those after from the last: the
same values at the same steps as a run that was never stopped, since a resumed run
continues exactly where its checkpoint was made (bit-exact on one machine with the same
settings: tests/test_sweep_stop.py). A run that finds its checkpoint at its last step
trains nothing and evaluates nothing; the file has its curve all the same.

A second signal can end a process after it kept an eval but before the checkpoint of
that step: before each attempt `truncate` drops what lies past the newest checkpoint;
should the run restore an older one (the newest damaged), the steps it evaluates again
are read from the later lines (`read`: the later of two for one step).
"""

from __future__ import annotations

import json
import os

from mgloop.runs import callbacks as callbacks_lib

FILENAME = "sweep_evals.jsonl"


def path_of(logdir: str) -> str:
    return os.path.join(logdir, FILENAME)


def read(logdir: str) -> list[dict]:
    """The kept records in step order, one per step (the later of two for one step: the
    attempt that went on from it); a torn last line (a process ended mid-write) is left
    out."""
    by_step = {}
    try:
        with open(path_of(logdir)) as handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        by_step[rec["step"]] = rec
    return [by_step[step] for step in sorted(by_step)]


def truncate(logdir: str, last_step: int) -> None:
    """Keeps only the records at steps <= last_step (rewritten atomically)."""
    path = path_of(logdir)
    if not os.path.exists(path):
        return
    kept = [rec for rec in read(logdir) if rec["step"] <= last_step]
    temporary = path + ".tmp"
    with open(temporary, "w") as handle:
        handle.writelines(json.dumps(rec) + "\n" for rec in kept)
    os.replace(temporary, path)


class Keeper:
    """A run callback (callbacks.py): appends each record of a loop that evaluated."""

    def __init__(self, logdir: str):
        self.path = path_of(logdir)

    def __call__(self, step: int, metrics: dict) -> bool:
        if any(key.startswith("eval/") for key in metrics):
            with open(self.path, "a") as handle:
                handle.write(json.dumps({"step": step, **metrics}, default=float) + "\n")
        return False


def history(logdir: str) -> callbacks_lib.History:
    """The kept records as a History (what record.py reads of a run's)."""
    out = callbacks_lib.History()
    for rec in read(logdir):
        out(rec["step"], {k: v for k, v in rec.items() if k != "step"})
    return out
