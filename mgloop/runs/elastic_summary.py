"""The rounds of an elastic job in summary.json: each round's workers, steps and bytes.

An elastic job (cluster/elastic.py) runs in rounds of W workers, each resuming from the
last complete checkpoint; the launcher hands every round its record of the rounds so far
(the environment's `elastic.ROUNDS_VARIABLE`). The summary of the round that ends the job
holds them all (`elastic_rounds`):

    rounds[r] = {workers W_r, first_step s_r, last_step s_{r+1}, steps, why it ended,
                 traffic T_r}
    T_r = sum over the steps s_r .. s_{r+1} - 1 of what a step of round r moves (its
          occasions: syncs every H steps count on their steps only)
    total = sum_r T_r,   per step = total / sum_r (s_{r+1} - s_r)

A round's steps end where the next one resumed: the steps a failed round ran past its
last complete checkpoint are run again, and counted, in the next. A round's own chief
writes T_r at each checkpoint it saves (`RoundLedger`, under <logdir>/elastic_rounds/),
so a killed round's bytes are known up to the checkpoint the next round resumed from.
Where no count exists (the file lost), the round's bytes are null, and so are the
totals: never the last round's per-step bytes for the whole job.
"""

from __future__ import annotations

import collections
import json
import os
from typing import Callable

from mgloop.aggregation.traffic import Traffic
from mgloop.cluster import elastic

LEDGER_FOLDER = "elastic_rounds"


def launched_rounds() -> dict | None:
    """The launcher's record of an elastic job's rounds so far, this one last
    ({"job", "rounds": [{"workers", "from_step", "restarts", "ended"}]},
    cluster/elastic.py), from this worker's environment; None outside an elastic job."""
    text = os.environ.get(elastic.ROUNDS_VARIABLE)
    return json.loads(text) if text else None


def previous_summary(config) -> dict:
    """The summary.json already in the logdir ({} if none or unreadable)."""
    try:
        with open(os.path.join(config.logdir, "summary.json")) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}


def occasion_counts(traffic: Traffic, start: int, end: int,
                    into: collections.Counter | None = None) -> collections.Counter:
    """{the occasions a step has: how many of the steps start..end-1 have them}, added to
    `into` if given (a count kept up to `start` grows without counting again)."""
    counts = collections.Counter() if into is None else into
    counts.update(map(traffic.occurring, range(start, end)))
    return counts


def traffic_over(traffic: Traffic, first: int, last: int,
                 own: tuple[int, int], counted: collections.Counter | None = None) -> dict:
    """{"bytes", "messages"}: per device {"sent", "received"}, summed over the 0-based
    steps first..last-1, each step what `traffic` says it moves (its occasions). Counts
    measured as the steps ran (aggregation/measured.py) enter at their mean per occurrence
    over the steps `own` = (start, end) this process ran. `counted`: the occasion counts of
    first..last-1 when (first, last) is `own`, already made (occasion_counts)."""
    ran = counted if counted is not None else occasion_counts(traffic, *own)
    measured = traffic.with_measured(lambda name: sum(
        count for key, count in ran.items() if name in key))
    total = Traffic(node_of=dict(traffic.node_of))
    steps = ran if (first, last) == tuple(own) else occasion_counts(traffic, first, last)
    for key, count in steps.items():
        total.add_scaled(measured.of_occasions(key), count)
    return {"bytes": total.as_dict(), "messages": total.messages_as_dict()}


def elastic_rounds(launched: dict, previous: dict, start_step: int, final_step: int,
                   ended: str, traffic_of: Callable[[int, int], dict] | None,
                   recorded: dict[int, dict[int, dict]] | None = None) -> dict:
    """The summary keys of an elastic job ending its current round, which ran steps
    start_step..final_step-1 and `ended` so: `rounds`, `rounds_total`, and `start_step`,
    `traffic_bytes_per_step`, `traffic_messages_per_step` over every round.

    `launched`: the launcher's rounds (launched_rounds), this one last; `previous`: the
    summary.json before this round (its rounds, when of the same job, give the first
    steps their chiefs saw and the traffic they counted); `traffic_of(first, last)`: this
    round's traffic over those steps (traffic_over), None if unknown. A round's steps run
    from the step it resumed from to the one the next round resumed from (steps a failed
    round ran past its last checkpoint are run again, and counted, in the next one); a
    round without its own count (a failed round's chief writes nothing) takes this round's
    traffic over its steps if it had the same worker count, else its bytes are unknown
    (null) and so are the totals. `recorded` {round: {step: traffic}}: what each round's
    chief counted at its checkpoints (RoundLedger); a round without a count of its own
    takes the one of the step it ended at (where the next round resumed) first."""
    job, launched = launched["job"], launched["rounds"]
    kept = previous.get("rounds") or [] if previous.get("elastic_job") == job else []
    rounds = []
    for index, record in enumerate(launched):
        saw = kept[index] if index < len(kept) else {}
        rounds.append({"round": index, "workers": record["workers"],
                       "first_step": saw.get("first_step", record["from_step"]),
                       "restarts_before": record["restarts"],
                       "ended": record.get("ended") or saw.get("ended"),
                       "traffic": saw.get("traffic"),
                       "traffic_from": saw.get("traffic_from")})
    this = rounds[-1]
    this.update(first_step=start_step, ended=ended)
    for one, following in zip(rounds, rounds[1:]):
        one["last_step"] = following["first_step"]
    this["last_step"] = final_step
    for one in rounds:
        one["steps"] = one["last_step"] - one["first_step"]
    for one in rounds[:-1]:
        at_end = (recorded or {}).get(one["round"], {}).get(one["last_step"])
        if one["traffic"] is None and at_end is not None:
            one.update(traffic=at_end, traffic_from="its chief, at its last checkpoint")
    if traffic_of is not None:
        this.update(traffic=traffic_of(start_step, final_step), traffic_from="this round")
        for one in rounds[:-1]:
            if one["traffic"] is None and one["workers"] == this["workers"]:
                one.update(traffic=traffic_of(one["first_step"], one["last_step"]),
                           traffic_from=f"round {this['round']} (the same worker count)")
    unknown = [one["round"] for one in rounds if one["traffic"] is None]
    steps = sum(one["steps"] for one in rounds)
    totals = ({kind: _summed([one["traffic"][kind] for one in rounds])
               for kind in ("bytes", "messages")} if not unknown else None)
    per_step = ({kind: {device: {way: count / steps for way, count in ways.items()}
                        for device, ways in total.items()}
                 for kind, total in totals.items()} if totals and steps else None)
    return {"elastic_job": job, "rounds": rounds,
            "rounds_total": {"rounds": len(rounds), "steps": steps,
                             "restarts": this["restarts_before"], "traffic": totals,
                             "traffic_unknown_rounds": unknown},
            "start_step": rounds[0]["first_step"],
            "traffic_bytes_per_step": per_step["bytes"] if per_step else None,
            "traffic_messages_per_step": per_step["messages"] if per_step else None}


def _summed(per_device: list[dict]) -> dict:
    """{device: {"sent", "received"}} added up over the dicts (a device absent: 0)."""
    total: dict = {}
    for counts in per_device:
        for device, ways in counts.items():
            mine = total.setdefault(device, {"sent": 0, "received": 0})
            for way, count in ways.items():
                mine[way] += count
    return total


def _ledger_path(logdir: str, job: str, index: int) -> str:
    return os.path.join(logdir, LEDGER_FOLDER, f"{job}-round-{index}.json")


def recorded_rounds(logdir: str, launched: dict) -> dict[int, dict[int, dict]]:
    """{round: {step: traffic}} that the job's earlier rounds' chiefs wrote (RoundLedger)."""
    out = {}
    for index in range(len(launched["rounds"])):
        try:
            with open(_ledger_path(logdir, launched["job"], index)) as handle:
                out[index] = {int(step): t for step, t in json.load(handle)["saved"].items()}
        except (OSError, ValueError, KeyError):
            continue
    return out


class RoundLedger:
    """The chief's saver in an elastic round: saves as `saver` does, then writes this
    round's traffic from its first step to the saved one (traffic_over) into its file
    under <logdir>/elastic_rounds/ (written whole to a temporary name and renamed), keeping
    the counts of the last `keep` saves (one of which the next round resumes from)."""

    def __init__(self, saver, logdir: str, launched: dict, traffic: Traffic,
                 start_step: int, keep: int):
        self.saver, self.traffic, self.start, self.keep = saver, traffic, start_step, keep
        self.path = _ledger_path(logdir, launched["job"], len(launched["rounds"]) - 1)
        self.saved: dict[int, dict] = {}
        self.counted, self.counted_to = collections.Counter(), start_step  # grown per save

    @property
    def latest(self):
        return self.saver.latest

    def save(self, step: int):
        path = self.saver.save(step)
        occasion_counts(self.traffic, self.counted_to, step, into=self.counted)
        self.counted_to = step  # each step's occasions counted once over the whole round
        self.saved[step] = traffic_over(self.traffic, self.start, step, (self.start, step),
                                        self.counted)
        for old in sorted(self.saved)[:-max(self.keep, 1)]:
            del self.saved[old]
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        temporary = self.path + ".tmp"
        with open(temporary, "w") as handle:
            json.dump({"first_step": self.start,
                       "saved": {str(s): t for s, t in self.saved.items()}}, handle)
        os.replace(temporary, self.path)
        return path


def ledger(saver, logdir: str, traffic: Traffic, start_step: int, keep: int, chief: bool):
    """`saver` as the loop should call it: a RoundLedger around it on an elastic round's
    chief, else itself."""
    launched = launched_rounds()
    if launched is None or not chief or saver is None:
        return saver
    return RoundLedger(saver, logdir, launched, traffic, start_step, keep)


def keys_at_end(config, trainer, start_step: int, final_step: int, ended: str) -> dict:
    """The summary keys of every round (elastic_rounds) when this round ends `ended`,
    having run start_step .. final_step - 1; {} outside an elastic job."""
    launched = launched_rounds()
    if launched is None:
        return {}
    traffic = trainer.aggregation.traffic
    own = (start_step, final_step)
    return elastic_rounds(launched, previous_summary(config), start_step, final_step, ended,
                          lambda first, last: traffic_over(traffic, first, last, own),
                          recorded_rounds(config.logdir, launched))
