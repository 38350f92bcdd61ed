"""summary.json of an elastic job describes every round (runs/elastic_summary.elastic_rounds): its
workers, its steps, why it ended, and the bytes summed over the rounds as they ran, each
round's steps times its own per-step traffic; never the last round's for the whole job."""

import json
import os

import pytest

import mgloop
from mgloop.cluster import elastic
from mgloop.runs import elastic_summary
from tests import helpers

JOB = "1234-5"


def _launched(*rounds):
    """The launcher's record (cluster/elastic.run): (workers, from_step, restarts, ended)."""
    return {"job": JOB, "rounds": [
        {"workers": w, "from_step": s, "restarts": r, **({"ended": e} if e else {})}
        for w, s, r, e in rounds]}


def _ring(workers):
    """A stand-in traffic_of for a round of `workers`: each device sends and receives
    2 (W - 1) / W x 1000 bytes per step and 2 (W - 1) messages (a ring all-reduce)."""
    def traffic_of(first, last):
        steps = last - first
        return {kind: {f"/task:{t}": {"sent": per * steps, "received": per * steps}
                       for t in range(workers)}
                for kind, per in (("bytes", 2 * (workers - 1) / workers * 1000),
                                  ("messages", 2 * (workers - 1)))}
    return traffic_of


def test_a_3_then_2_worker_job_is_two_rounds_and_unknown_bytes_are_not_the_last_rounds():
    """Steps 0-120 on 3 workers (one killed), 120-600 on 2: the summary has both rounds,
    start_step 0; with no count of the killed round (its chief's record lost) its bytes are
    unknown and the totals say so (null), instead of 600 steps of a 2-node ring."""
    launched = _launched((3, 0, 0, "failed: worker 2 was killed by signal SIGKILL"),
                         (2, 120, 1, None))
    keys = elastic_summary.elastic_rounds(launched, {}, 120, 600, "done: trained to step 600",
                                  _ring(2))
    rounds = keys["rounds"]
    assert [(r["workers"], r["first_step"], r["last_step"], r["steps"]) for r in rounds] == [
        (3, 0, 120, 120), (2, 120, 600, 480)]
    assert rounds[0]["ended"] == "failed: worker 2 was killed by signal SIGKILL"
    assert rounds[1]["ended"] == "done: trained to step 600"
    assert [r["restarts_before"] for r in rounds] == [0, 1]
    assert keys["start_step"] == 0
    assert rounds[0]["traffic"] is None and rounds[1]["traffic_from"] == "this round"
    assert keys["rounds_total"] == {"rounds": 2, "steps": 600, "restarts": 1, "traffic": None,
                                    "traffic_unknown_rounds": [0]}
    assert keys["traffic_bytes_per_step"] is None


def test_the_bytes_are_each_rounds_steps_times_its_own_per_step_bytes():
    """3 workers 0-40 (killed), 2 workers 40-100 (stopped to take the slot back: its chief
    wrote summary.json, without traffic), 3 workers 100-300 (done). The last chief counts
    its own round and, with the same worker count, the killed round's; the 2-worker
    round's traffic comes from its own record when it has one."""
    stopped = elastic_summary.elastic_rounds(
        _launched((3, 0, 0, "failed: worker 2 was killed by signal SIGKILL"),
                  (2, 40, 1, None)), {}, 40, 100, "stopped by SIGTERM", None)
    assert stopped["rounds"][1]["traffic"] is None  # not counted (its traffic_of: None)
    previous = {"elastic_job": JOB, **stopped}
    previous["rounds"][1].update(traffic=_ring(2)(40, 100), traffic_from="this round")
    launched = _launched((3, 0, 0, "failed: worker 2 was killed by signal SIGKILL"),
                         (2, 40, 1, "rejoin: stopped to take a replacement back"),
                         (3, 100, 1, None))
    keys = elastic_summary.elastic_rounds(launched, previous, 100, 300, "done", _ring(3))
    rounds = keys["rounds"]
    assert [(r["workers"], r["first_step"], r["last_step"]) for r in rounds] == [
        (3, 0, 40), (2, 40, 100), (3, 100, 300)]
    assert [r["traffic_from"] for r in rounds] == [
        "round 2 (the same worker count)", "this round", "this round"]
    ring3, ring2 = 2 * 2 / 3 * 1000, 2 * 1 / 2 * 1000
    total = keys["rounds_total"]["traffic"]["bytes"]
    assert total["/task:0"]["sent"] == pytest.approx(40 * ring3 + 60 * ring2 + 200 * ring3)
    assert total["/task:2"]["sent"] == pytest.approx(240 * ring3)  # not in the 2-worker round
    per_step = keys["traffic_bytes_per_step"]
    assert per_step["/task:0"]["received"] == pytest.approx(total["/task:0"]["received"] / 300)
    assert keys["traffic_messages_per_step"]["/task:1"]["sent"] == pytest.approx(
        (240 * 4 + 60 * 2) / 300)
    assert keys["rounds_total"]["traffic_unknown_rounds"] == []
    # a summary.json of another job (or of a plain run) gives nothing
    other = elastic_summary.elastic_rounds(launched, {**previous, "elastic_job": "other"}, 100, 300,
                                   "done", _ring(3))
    assert other["rounds"][1]["traffic"] is None


def _round(logdir, devices, train_steps, monkeypatch, launched=None):
    if launched is None:
        monkeypatch.delenv(elastic.ROUNDS_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(elastic.ROUNDS_VARIABLE, json.dumps(launched))
    return mgloop.run(helpers.small_config(
        str(logdir), devices=devices, aggregation="ring", global_batch_size=12,
        train_steps=train_steps, steps_per_loop=3, checkpoint_every=3)).summary


def test_a_real_resume_with_other_devices_sums_each_rounds_own_bytes(tmp_path, monkeypatch):
    """Two rounds of real runs on one logdir, the launcher's record in the environment as
    the launcher gives it: steps 0-6 with a 3-tower ring, then 6-15 with 2 towers. The
    first round leaves no summary.json (as a killed round's chief writes none): its
    bytes come from what its chief wrote at its checkpoints (RoundLedger). The summary's
    totals are 6 steps of the first's bytes plus 9 of the second's, each as a plain run of
    that layout counts per step."""
    plain3 = _round(tmp_path / "plain3", "cpu:3", 3, monkeypatch)["traffic_bytes_per_step"]
    plain2 = _round(tmp_path / "plain2", "cpu:2", 3, monkeypatch)["traffic_bytes_per_step"]
    first = _launched((1, 0, 0, None))
    _round(tmp_path / "job", "cpu:3", 6, monkeypatch, first)
    os.remove(tmp_path / "job" / "summary.json")  # killed: its chief wrote no summary
    second = _launched((1, 0, 0, "failed: worker 0 was killed by signal SIGKILL"),
                       (1, 6, 1, None))
    summary = _round(tmp_path / "job", "cpu:2", 15, monkeypatch, second)
    with open(tmp_path / "job" / "summary.json") as handle:
        assert json.load(handle)["rounds"] == json.loads(json.dumps(summary["rounds"]))
    assert [(r["first_step"], r["last_step"], r["traffic_from"]) for r in summary["rounds"]
            ] == [(0, 6, "its chief, at its last checkpoint"), (6, 15, "this round")]
    assert summary["start_step"] == 0 and summary["rounds_total"]["steps"] == 15
    total = summary["rounds_total"]["traffic"]["bytes"]
    assert set(total) == set(plain3) and len(plain2) == 2
    for device, ways in total.items():
        for way, count in ways.items():
            expected = 6 * plain3[device][way] + 9 * plain2.get(device, {}).get(way, 0)
            assert count == pytest.approx(expected), (device, way)
    assert plain3 != plain2  # the two layouts move different bytes: the test can tell
