"""experiments/link_check.py's figures, on hand-made per-step times and summaries (no job
runs): which steps sync, the medians composed as the link model averages, the modelled
sync step with and without overlap, the ratios and the 15% verdict."""

import math

import pytest

from experiments import link_calibration
from experiments import link_check
from experiments import time_to_target
from mgloop.observe import link_model

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


# The calibration (experiments/link_calibration.py), on steps made by a known link.

LINK = (0.95, 40e6, 0.0004)  # eta, the processing rate P (bytes/s), alpha (s per message)


def made_row(workers, bandwidth, sent, messages, compute, link=LINK, steps=100):
    """A cell whose step is exactly C + S / (eta B) + S / P + alpha m."""
    eta, rate, alpha = link
    shaped = link_model.parse(f"between:{bandwidth},0us").bytes_per_second
    step = compute + sent / (eta * shaped) + sent / rate + alpha * messages
    return {"method": "ring", "spec": "ring", "workers": workers, "bandwidth": bandwidth,
            "step": step, "sync_step": None, "groups": {"other": {"median": step, "steps": steps}},
            "modelled": {"compute": compute},
            "shaped_link_model": {"bytes_per_device": sent, "messages_per_device": messages,
                                  "steps": steps, "syncs": {}}}


def made_rows(link=LINK):
    return [made_row(w, b, sent, messages, compute, link) for w in (2, 4)
            for b in ("10mbit", "50mbit", "200mbit")
            for sent, messages, compute in ((170_000, 2 * (w - 1), 0.003),
                                            (5_000, 3 * (w - 1), 0.004))]


def test_the_calibration_recovers_the_link_that_made_the_steps():
    fitted = link_calibration.fit(made_rows())
    assert (fitted.efficiency, fitted.processing_bytes_per_second,
            fitted.per_message_seconds) == pytest.approx(LINK, rel=1e-6)
    assert fitted.cells == 12
    link = fitted.link(50e6 / 8)
    assert 1 / link.bytes_per_second == pytest.approx(1 / (0.95 * 50e6 / 8) + 1 / 40e6)
    assert link.latency_seconds == pytest.approx(0.0004)
    parsed = link_model.parse("between:" + link.name)  # a --link a study can be given
    assert parsed.bytes_per_second == pytest.approx(link.bytes_per_second, rel=1e-3)
    held = link_calibration.held_out(made_rows())
    assert sorted(held) == [2, 4] and [h.cells for h in held.values()] == [6, 6]


def test_a_cost_the_steps_do_not_show_is_held_at_zero():
    fitted = link_calibration.fit(made_rows((0.9, math.inf, 0.001)))
    assert math.isinf(fitted.processing_bytes_per_second)
    assert fitted.efficiency == pytest.approx(0.9) and fitted.per_message_seconds == \
        pytest.approx(0.001)
    assert fitted.link(1e6).bytes_per_second == pytest.approx(0.9e6)
    with pytest.raises(ValueError, match="3 or more"):
        link_calibration.fit(made_rows()[:2])


def test_the_modelled_step_composes_an_overlapped_sync_as_the_link_model():
    """One fragment of 16,000 B in 2 messages every 16 steps, hidden behind 2 steps of
    C = 2 ms, on 1 MB/s with 1 ms a message: its step 2 + (18 - 4) ms, the others C."""
    traffic = {"bytes_per_device": 1000.0, "messages_per_device": 0.125, "steps": 16,
               "syncs": {"fragment 0": {"bytes_per_device": 16_000, "messages_per_device": 2,
                                        "occurrences": 1}}}
    groups = {"fragment 0": {"median": 0.02, "steps": 1}, "other": {"median": 0.002, "steps": 15}}
    link = link_model.Link("8mbit,1ms", 1e6, 0.001)
    overlapped = link_check.SyncRule(16, 0, (16,), overlap=2, merges=True)
    figures = link_check.modelled_step(traffic, 0.002, link, overlapped, groups)
    assert figures["sync"] == pytest.approx(0.002 + 0.014)
    assert figures["step"] == pytest.approx((0.016 + 15 * 0.002) / 16)
    plain = link_check.modelled_step(traffic, 0.002, link, link_check.SyncRule(16), {})
    assert plain["step"] == pytest.approx(0.002 + 1000 / 1e6 + 0.001 * 0.125)


def test_calibrate_adds_the_calibrated_and_held_out_columns():
    rows = made_rows()
    calibration = link_check.calibrate(rows, {"ring": link_check.SyncRule()}, 0.15)
    assert calibration["all"]["cells"] == 12 and sorted(calibration["held_out"]) == [2, 4]
    assert set(calibration["links"]) == {"10mbit", "50mbit", "200mbit"}
    for row in rows:
        assert row["calibrated_ratio"] == pytest.approx(1.0)
        assert row["held_out_ratio"] == pytest.approx(1.0)
        assert row["calibrated_within"] == "ok"
    assert link_check.calibrate(rows[:2], {"ring": link_check.SyncRule()}, 0.15) is None


# experiments/time_to_target.py's reading of a run.


def test_the_target_step_and_the_training_seconds_to_it():
    points = {32: 0.85, 64: 0.91, 96: 0.89, 128: 0.95}
    assert time_to_target.reached(points, ">=", 0.9) == 64
    assert time_to_target.reached(points, "<=", 0.86) == 32
    assert time_to_target.reached(points, ">=", 0.99) is None
    times = {g: 0.010 for g in range(2, 65)}
    times[40] = 0.200  # one slow step: in the sum, not in the median standing for step 1
    assert time_to_target.seconds_to(32, times) == pytest.approx(0.010 + 31 * 0.010)
    assert time_to_target.seconds_to(64, times) == pytest.approx(0.010 + 62 * 0.010 + 0.200)
    assert time_to_target.mean_sd([1.0, 3.0]) == "2.00 ± 1.41"
    assert time_to_target.mean_sd([96], 0) == "96 ± 0" and time_to_target.mean_sd([]) == "—"


def test_time_to_target_refuses_bad_settings_before_any_job():
    """Each in one line: a bandwidth the link model cannot read, a rate that is NaN, inf
    or 0, an eval interval that splits a period (the modelled seconds would be wrong)."""
    good = {"--learning_rate": 0.1, "--steps": 256}
    refused = time_to_target.refusal
    assert "bandwidth 'fast'" in refused("fast", ["ring"], 32, good, 4)
    for bad in (float("nan"), float("inf"), 0.0):
        assert refused("10mbit", ["ring"], 32, dict(good, **{"--learning_rate": bad}),
                       4) == f"--learning_rate={bad}: give a finite number > 0"
    assert "not a multiple of diloco's period 16" in refused("10mbit", ["ring", "diloco"],
                                                            24, good, 4)
    answer = refused("10mbit", list(time_to_target.METHODS), 32, good, 4)
    assert answer is None or "--netns" in answer  # here: None as root; else netns's line
