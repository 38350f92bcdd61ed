"""A cell's evals kept in its logdir, so that a stopped cell resumes from its checkpoint
and still records its whole curve.

A run resumed from a checkpoint at step S has in its History only the evals after S
(run_result.py). The sweep passes each cell's run a `Keeper` callback, which appends
every record {"step": s, **metrics} of a loop that evaluated to
`<logdir>/sweep_evals.jsonl`, one JSON line each (floats as repr: read back exactly) and
flushed at once. The cell's record then takes the evals at steps <= S from the file and
those after S from the run (`merged`): the same values at the same steps as a run that
was never stopped, since a resumed run continues exactly where its checkpoint was made
(bit-exact on one machine with the same settings).

A second signal can end a process after it kept an eval but before the checkpoint of
that step: before each attempt `truncate` drops what lies past the newest checkpoint,
and `merged` takes from the file nothing past the step the run started from.
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


def merged(logdir: str, start_step: int, history: callbacks_lib.History | None
           ) -> callbacks_lib.History:
    """A History of the kept records at steps <= start_step, then `history`'s records
    (those of the run that started at start_step; None: it trained nothing)."""
    out = callbacks_lib.History()
    for rec in read(logdir):
        if rec["step"] <= start_step:
            out(rec["step"], {k: v for k, v in rec.items() if k != "step"})
    for rec in history.records if history is not None else ():
        if rec["step"] > start_step:
            out(rec["step"], {k: v for k, v in rec.items() if k != "step"})
    return out
