"""experiments/link_check.py's figures, on hand-made per-step times and summaries (no job
runs): which steps sync, the medians composed as the link model averages, the modelled
sync step with and without overlap, the ratios and the 15% verdict."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import link_check  # noqa: E402

STREAMING = link_check.SyncRule(16, 0, (4, 8, 12, 16), overlap=2, merges=True)


def test_the_groups_are_the_occasions_of_the_methods():
    diloco = link_check.SyncRule(16)
    assert [g for g in range(1, 49) if diloco.group(g) == "sync"] == [16, 32, 48]
    warm = link_check.SyncRule(8, warmup=3)
    assert [warm.group(g) for g in (1, 3, 4, 11, 19)] == ["warmup", "warmup", "other", "sync",
                                                          "sync"]
    assert [STREAMING.group(g) for g in (2, 4, 6, 8, 10, 16, 18, 20)] == [
        "other", "fragment 0", "fragment 0 merge", "fragment 1",
        "fragment 1 merge", "fragment 3", "fragment 3 merge", "fragment 0"]
    assert link_check.SyncRule().group(16) == "other"
    assert [link_check.is_sync(n) for n in ("sync", "fragment 2", "fragment 2 merge",
                                            "other", "warmup")] == [True, True, False, False,
                                                                    False]


def test_medians_are_composed_by_their_steps():
    times = {g: 0.010 for g in range(2, 17)}
    times.update({16: 0.100, 8: 0.011})
    groups = link_check.group_medians(times, link_check.SyncRule(16))
    assert groups == {"other": {"median": 0.010, "steps": 14},
                      "sync": {"median": 0.100, "steps": 1}}
    medians = link_check.medians(groups)
    assert link_check.composed(medians, groups) == pytest.approx((14 * 0.010 + 0.100) / 15)
    assert link_check.composed(medians, groups, link_check.is_sync) == 0.100
    assert link_check.composed(medians, groups, lambda name: name == "none") is None


def test_a_sync_step_hides_behind_the_steps_of_its_overlap():
    plain = link_check.sync_modelled(0.002, 0.001, 0.010, 0)
    assert plain == pytest.approx({"no_overlap": 0.013, "overlap": 0.011})
    hidden = link_check.sync_modelled(0.002, 0.0, 0.010, 2)
    assert hidden == pytest.approx({"no_overlap": 0.012, "overlap": 0.002 + 0.006})
    assert link_check.sync_modelled(0.002, 0.0, 0.003, 2)["overlap"] == 0.002


def test_the_ratio_and_the_verdict():
    assert link_check.ratio(0.0115, 0.010) == pytest.approx(1.15)
    assert link_check.within(1.15, 0.15) == "ok"
    assert link_check.within(0.84, 0.15) == "off"
    assert link_check.ratio(None, 0.01) is None and link_check.ratio(0.01, None) is None
    assert link_check.within(None, 0.15) == "–"


def test_a_row_against_the_unshaped_jobs_model():
    summary = {"link_model": {
        "steps": 32, "compute_seconds": 0.002,
        "links": {"between_50mbit_0us": {
            "exchange_seconds": 0.001, "exchange_seconds_slowest_step": 0.016,
            "step_seconds_no_overlap": 0.003, "step_seconds_overlap": 0.0025}},
        "syncs": {"sync": {"occurrences": 2, "bytes_per_device": 100000,
                           "messages_per_device": 2}}}}
    link = link_check.link_model.parse("between:50mbit,0us")
    modelled = link_check.modelled_figures(summary, link, 0)
    assert modelled["syncs"]["sync"]["exchange"] == pytest.approx(0.016)  # 100 kB at 6.25 MB/s
    assert modelled["every_step_exchange"] == pytest.approx(0.0)
    times = {g: 0.004 for g in range(2, 33)}
    times.update({16: 0.030, 32: 0.028})
    row = link_check.cell_row("diloco", "diloco:period=16", 2, "50mbit",
                              link_check.SyncRule(16), {"summary": {"median_step_time": 0.002}},
                              {"summary": {"median_step_time": 0.004}, "step_times": times},
                              modelled, 0.15)
    assert row["sync_step"] == pytest.approx(0.029)
    assert row["sync_modelled"] == pytest.approx(0.018)  # C + X_s, no overlap claimed
    assert row["step"] == pytest.approx((29 * 0.004 + 2 * 0.029) / 31)
    assert row["ratio"] == pytest.approx(row["step"] / 0.003)
    assert (row["within"], row["unshaped_step_ms"], row["merge_step"]) == ("off", 2.0, None)
