"""Tuning in a sweep (mgloop/runs/sweep/tune.py, `--tune`, `--tune_seeds`): the axes and
their refusals, the score and the choice, a real tuning sweep of a tiny language model to
a perplexity target (resumed), and the plots' small multiples."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from mgloop.errors import ConfigError
from mgloop.runs.sweep import grid
from mgloop.runs.sweep import plan as plan_lib
from mgloop.runs.sweep import plot_panels
from mgloop.runs.sweep import record
from mgloop.runs.sweep import report
from mgloop.runs.sweep import runner
from mgloop.runs.sweep import search
from mgloop.runs.sweep import target as target_lib
from mgloop.runs.sweep import tune
from mgloop.runs.sweep import tuning_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _variant(spec, **settings):
    return grid.Variant(f"aggregation={spec}", {"aggregation": spec},
                        {"aggregation": spec, **settings}, (("aggregation", spec),))


def test_tune_axes_points_and_settings_and_their_refusals():
    kinds = grid.field_types()
    axes = tune.parse(["learning_rate=0.01,0.1", "aggregation.outer_lr=0.5;0.7"], kinds)
    assert [(a.key, a.values, a.option) for a in axes] == [
        ("learning_rate", ("0.01", "0.1"), None), ("aggregation.outer_lr", ("0.5", "0.7"),
                                                    "outer_lr")]
    ring, diloco = _variant("ring"), _variant("diloco:period=2")
    assert tune.points(axes, ring) == [(("learning_rate", "0.01"),), (("learning_rate", "0.1"),)]
    assert tune.points(axes, diloco) == [
        (("learning_rate", lr), ("aggregation.outer_lr", o))
        for lr in ("0.01", "0.1") for o in ("0.5", "0.7")]  # the last axis fastest
    assert tune.points(axes[1:], ring) == [()]  # nothing to tune
    assert tune.settings_of(diloco, tune.points(axes, diloco)[1], kinds) == {
        "aggregation": "diloco:period=2,outer_lr=0.7", "learning_rate": 0.01}
    assert tune.settings_of(_variant("diloco"), (("aggregation.outer_lr", "0.5"),),
                            kinds)["aggregation"] == "diloco:outer_lr=0.5"
    assert tune.tuning_seeds(2) == (1000, 1001)
    for items, says in (
            (["learning_rate=fast"], "--tune learning_rate: 'fast' is not a float"),
            (["speed=1,2"], "--tune speed: neither a Config field nor aggregation.OPTION"),
            (["learning_rate="], "--tune 'learning_rate=': give KEY=V1,V2"),
            (["learning_rate=0.1,0.1"], "--tune learning_rate: '0.1,0.1': give distinct"),
            (["momentum=0.9", "momentum=0.5"], "--tune momentum: given twice"),
            (["seed=1,2"], "--tune seed: the sweep sets it")):
        with pytest.raises(grid.SpecError, match="^" + re.escape(says)):
            tune.parse(items, kinds)
    with pytest.raises(grid.SpecError, match="sets outer_lr in its spec"):
        tune.points(axes, _variant("diloco:outer_lr=0.5"))
    with pytest.raises(grid.SpecError, match="learning_rate: also given by --vary or --set"):
        tune.points(axes, _variant("ring", learning_rate=0.1))
    with pytest.raises(grid.SpecError, match=r"aggregation.outer_lr: no variant's method has "
                                             r"the option 'outer_lr' \(methods: ring\)"):
        tune.check(axes, [ring])


def _rec(loss, accuracy=0.5, seed=1000, diverged=False):
    rec = {"seed": seed, "curve": [{"step": 4, "eval/loss": loss, "eval/accuracy": accuracy}]}
    return {**rec, "diverged": "nan"} if diverged else rec


def test_the_score_is_the_mean_final_metric_and_the_best_point_is_chosen():
    """Lowest mean eval loss by default, the target's metric and direction if given; ties to
    the first; a point with a diverged or missing seed has no score and is not chosen."""
    a, b, c = ((("learning_rate", v),) for v in ("0.01", "0.1", "1.0"))
    seeds = (1000, 1001)
    summary = tune.summarise([(a, [_rec(2.0), _rec(1.0, seed=1001)]),
                              (b, [_rec(1.4), _rec(1.6, seed=1001)]),
                              (c, [_rec(0.1), _rec(0.1, seed=1001, diverged=True)])],
                             None, seeds)
    assert [row["score"] for row in summary["tried"]] == [1.5, 1.5, None]
    assert summary["chosen"] == {"learning_rate": "0.01"}  # the tie: the first
    assert summary["metric"] == "eval/loss" and summary["lower_is_better"]
    higher = tune.summarise([(a, [_rec(1.0, 0.6), _rec(1.0, 0.7, seed=1001)]),
                             (b, [_rec(1.0, 0.8), _rec(1.0, 0.6, seed=1001)]),
                             (c, [_rec(1.0, 0.9)])],  # a seed missing: no score
                            "accuracy>=0.95", seeds)
    assert [row["score"] for row in higher["tried"]] == [(0.6 + 0.7) / 2, (0.8 + 0.6) / 2, None]
    assert higher["chosen"] == {"learning_rate": "0.1"}
    nothing = tune.summarise([(a, [_rec(1.0, diverged=True)]), (b, [])], None, (1000,))
    assert nothing["chosen"] is None  # no point has a score: none is chosen
    assert nothing["at_edge"] == {}


def test_a_winner_at_the_edge_of_a_numeric_axis_is_marked():
    """The lowest or highest value of a numeric axis is an edge (given in any order); the
    middle is not; a non-numeric axis has none; the report's table and its note say so."""
    def point(lr, outer, name="adam"):
        return (("learning_rate", lr), ("aggregation.outer_lr", outer), ("optimizer", name))
    grid_points = [point(lr, outer, name) for lr in ("0.003", "0.001", "0.01")
                   for outer in ("0.7", "1.0") for name in ("adam", "sgd")]
    def summary(best):
        return tune.summarise([(p, [_rec(0.5 if p == best else 1.0)]) for p in grid_points],
                              None, (1000,))
    assert summary(point("0.003", "0.7"))["at_edge"] == {"aggregation.outer_lr": "lowest"}
    assert summary(point("0.001", "1.0", "sgd"))["at_edge"] == {
        "learning_rate": "lowest", "aggregation.outer_lr": "highest"}
    inside = tune.summarise([(p, [_rec(0.5 if p[0][1] == "0.003" else 1.0)])
                             for p in [(("learning_rate", v),) for v in ("0.001", "0.003", "0.01")]],
                            None, (1000,))
    assert inside["chosen"] == {"learning_rate": "0.003"} and inside["at_edge"] == {}


def test_the_tuning_never_chooses_a_point_without_a_value(tmp_path):
    """The choice is among the points with a value of the metric: a point whose seed
    reported none (a metric absent from its evals) or diverged is never chosen over one
    with a value, whatever its place in the grid; when no point has one, nothing is
    chosen, the tuning table marks none, and the variant's final seeds are refused in one
    line (the runner runs none of them)."""
    a, b = ((("learning_rate", v),) for v in ("0.001", "0.003"))
    absent = [{"seed": 1000, "curve": [{"step": 4, "eval/loss": 0.5, "eval/accuracy": 0.9}]}]
    valued = [{"seed": 1000, "curve": [{"step": 4, "eval/loss": 4.3, "eval/perplexity": 77.4}]}]
    for tried, target, chosen in (([(a, absent), (b, valued)], "perplexity<=30", dict(b)),
                                  ([(a, valued), (b, absent)], "perplexity<=30", dict(a)),
                                  ([(a, [_rec(0.1, diverged=True)]), (b, [_rec(9.0)])], None,
                                   dict(b)),
                                  ([(a, absent), (b, absent)], "perplexity<=30", None)):
        assert tune.summarise(tried, target, (1000,))["chosen"] == chosen

    plan = plan_lib.Plan(vary=("optimizer=adam",), set=(
        "model=mlp", "dataset=synthetic", "devices=cpu:1", "global_batch_size=8",
        "train_steps=2", "checkpoint_every=0"), seeds=(0,), output_dir=str(tmp_path / "sweep"),
        evals=1, tune=("learning_rate=0.001,0.003",))
    for index, cell in enumerate(plan.tuning_cells()):  # every tuning cell diverged
        record.write(plan.result_path(cell), {
            "variant": cell.variant.name, "seed": cell.seed, "phase": "tuning", "axes": [],
            "tuned": dict(cell.point), "tune_index": index, "target": None, "diverged": "nan",
            "curve": [{"step": 2, "eval/loss": float("nan")}]})
    variant = plan.variants()[0]
    says = (r"^--tune: no point of variant optimizer=adam's tuning grid has a final eval/loss "
            r"on every tuning seed \[1000\] .* give --tune values that train")
    with pytest.raises(ConfigError, match=says):
        search.chosen_point(plan, variant)
    with pytest.raises(ConfigError, match=says):
        runner.run(plan)
    assert not [p for p in plan.cells() if os.path.exists(plan.result_path(p))]
    assert not os.path.exists(plan.logdir(plan.cells()[0]))  # no final seed ran
    table = tuning_report.section(plan.output_dir, [variant.name])
    assert not [line for line in table if "**chosen**" in line]
    rows = [line for line in table if line.startswith("| `")]
    assert "none chosen: no point has a score" in rows[0]


TEXT = "the quick brown fox jumps over the lazy dog; " * 40


def _lm_plan(tmp_path, target):
    (tmp_path / "text").mkdir(exist_ok=True)
    (tmp_path / "text" / "a.txt").write_text(TEXT)
    return plan_lib.Plan(
        vary=("optimizer=adam,sgd",),
        set=("model=transformer_lm", "dataset=text", f"data_dir={tmp_path / 'text'}",
             "sequence_length=8", "lm_layers=1", "lm_width=8", "lm_heads=1", "devices=cpu:1",
             "global_batch_size=8", "train_steps=2", "checkpoint_every=0"),
        seeds=(0,), output_dir=str(tmp_path / "sweep"), evals=1,
        target=target_lib.parse_target(target), tune=("learning_rate=0.001,0.01",))


def _diloco(plan):
    return dataclasses.replace(plan, vary=("aggregation=ring,diloco:period=2",),
                               set=tuple(s for s in plan.set if not s.startswith("devices="))
                               + ("devices=cpu:2",),
                               tune=("aggregation.outer_lr=0.5,1.0",))


def test_a_tuning_sweep_of_a_language_model_to_a_perplexity_target(tmp_path):
    """2 optimizers x 2 learning rates on tuning seed 1000, then seed 0 at each variant's
    best perplexity (its own tuning records): the records and report say what was tried
    and chosen; the LM's eval metrics are eval/loss and eval/perplexity, and targets on
    both are met or not; a re-run runs nothing, one with a tuning record lost runs just
    that cell. (An aggregation option's tuning cell's Config is checked without a run.)"""
    plan = _lm_plan(tmp_path, "perplexity<=1e6")
    tuning = plan.tuning_cells()
    assert [(c.variant.name, c.point, c.seed) for c in tuning] == [
        (v, (("learning_rate", lr),), 1000) for v in ("optimizer=adam", "optimizer=sgd")
        for lr in ("0.001", "0.01")]
    option = _diloco(plan)
    assert [c.variant.name for c in option.tuning_cells()] == [
        "aggregation=diloco:period=2"] * 2  # ring has no outer_lr: it tunes nothing
    config = option.config(option.tuning_cells()[1])
    assert (config.aggregation, config.seed) == ("diloco:period=2,outer_lr=1.0", 1000)
    with pytest.raises(grid.SpecError, match="final seeds reach the tuning seeds"):
        dataclasses.replace(plan, seeds=tuple(range(1001))).cells()

    paths = runner.run(plan)
    tuned = [(c, record.read(plan.result_path(c))) for c in tuning]
    finals = [record.read(p) for p in paths]
    assert len(report.load(plan.output_dir)) == 2  # tuning records kept apart
    for cell, rec in tuned:
        assert rec["phase"] == "tuning" and rec["seed"] == 1000
        assert rec["tuned"] == {"learning_rate": cell.point[0][1]}
        last = rec["curve"][-1]
        assert last["step"] == 2 and last["eval/perplexity"] > 1 and "eval/loss" in last
    for final in finals:
        mine = [(c, r) for c, r in tuned if c.variant.name == final["variant"]]
        scores = [r["curve"][-1]["eval/perplexity"] for _, r in mine]
        best = mine[int(np.argmin(scores))][0].point  # argmin: ties to the first
        assert final["phase"] == "final" and final["seed"] == 0
        assert final["tuned"] == dict(best)
        assert [row["score"] for row in final["tuning"]["tried"]] == scores
        assert final["tuning"]["chosen"] == dict(best)
        cell = next(c for c in plan.cells() if c.variant.name == final["variant"])
        summary = record.read(os.path.join(plan.logdir(cell), "summary.json"))
        assert summary["config"]["learning_rate"] == float(best[0][1])
        assert summary["config"]["seed"] == 0

        curve = final["curve"]  # the LM's metrics, and targets on them met or not
        assert final["time_to_target"]["step"] == 2
        for name in ("perplexity", "loss"):
            value = curve[-1][f"eval/{name}"]
            met = target_lib.parse_target(f"{name}<={value!r}")
            missed = target_lib.parse_target(f"{name}<={float(np.nextafter(value, 0))!r}")
            assert (met.metric, met.comparison) == (name, "<=")
            assert record.time_to_target(curve, met)["step"] == 2
            assert record.time_to_target(curve, missed) is None

    text = open(report.write(plan.output_dir, ["optimizer=adam", "optimizer=sgd"], "t")).read()
    assert "## Tuning" in text and text.count("**chosen**") == 2
    # two values a grid: every winner is at an edge, and the report says to widen it
    assert text.count(": widen)") == 2 and "At a grid's edge:" in text
    rows = [line for line in text.splitlines() if line.startswith("| `optimizer=")]
    assert len(rows) == 2 + 4  # the table's rows, then one per point tried
    for row, final in zip(rows, finals):
        assert f"| learning_rate={final['tuned']['learning_rate']} |" in row
    assert tuning_report.summaries(tuning_report.load(plan.output_dir), [])[
        finals[0]["variant"]]["chosen"] == finals[0]["tuned"]

    stamps = {p: os.stat(p).st_mtime_ns for p in paths + [plan.result_path(c) for c in tuning]}
    runner.run(plan)  # nothing left to run
    assert {p: os.stat(p).st_mtime_ns for p in stamps} == stamps
    lost = plan.result_path(tuning[1])
    os.remove(lost)
    assert runner.pending(plan, plan.tuning_cells()) == [tuning[1]]
    runner.run(plan)  # that tuning cell from its checkpoint at its last step; no other
    again = record.read(lost)
    assert again["curve"] == tuned[1][1]["curve"]
    assert {p: os.stat(p).st_mtime_ns for p in stamps if p != lost} == {
        p: s for p, s in stamps.items() if p != lost}

    command = [sys.executable, "-m", "mgloop.sweep", f"--output_dir={plan.output_dir}",
               "--seeds=1", "--evals=1", "--target=perplexity<=1e6", "--tune_seeds=1",
               *[f"--vary={v}" for v in plan.vary], *[f"--set={v}" for v in plan.set],
               *[f"--tune={v}" for v in plan.tune], "--report_only"]
    done = subprocess.run(command + ["--panels=optimizer"], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    text = open(os.path.join(plan.output_dir, "report.md")).read()
    assert "--tune=learning_rate=0.001,0.01" in text and text.count("**chosen**") == 2
    bad = subprocess.run(command + ["--panels=seed"], capture_output=True, text=True,
                         cwd=REPO, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "mgloop.sweep: error: --panels=seed: not a --vary axis; one of: optimizer")


def _records(names_axes, steps=(2, 4)):
    out = {}
    for index, (name, axes) in enumerate(names_axes):
        out[name] = [{"variant": name, "seed": seed, "axes": axes, "tuned": {},
                      "curve": [{"step": s, "eval/loss": 1.0 + index - s / 4 + 0.1 * seed,
                                 "gradient_bytes": 100 * s, "seconds": {}} for s in steps]}
                     for seed in (0, 1, 2)]
    return out


def test_plots_split_into_panels(tmp_path, monkeypatch):
    """The saved figures' Axes: one panel for at most 6 curves; runs of at most 6 for 8
    variants of one axis; one per value of the last axis (2 x 4 variants) or of --panels;
    a band from the least to the most seed."""
    from matplotlib.figure import Figure
    from mgloop.observe import plots
    saved = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (saved.append(
        [ax.get_title() for ax in self.axes]), real(self, *a, **k))[1])
    one = _records([(f"lr={v}", [["lr", str(v)]]) for v in range(8)])
    crossed = _records([(f"a={a},b={b}", [["a", a], ["b", b]])
                        for a in "xyzw" for b in "pq"])
    cases = [(dict(list(one.items())[:6]), None, 1, [""]),
             (one, None, 2, ["1 of 2", "2 of 2"]),
             (crossed, None, 2, ["b=p", "b=q"]),
             (crossed, "a", 4, ["a=x", "a=y", "a=z", "a=w"])]
    for groups, key, count, titles in cases:
        split = plot_panels.panels(groups, key)
        assert len(split) == count and all(len(c) <= 6 for c in split.values())
        saved.clear()
        plots.plot(split, "eval/loss", lambda p: p["step"], "steps",
                   str(tmp_path / "p.png"), "t")
        assert saved == [titles]  # one Axes per panel, none empty
    assert list(plot_panels.panels(crossed, "a")["a=x"]) == ["b=p", "b=q"]
    with pytest.raises(ValueError, match="--panels=c: not a --vary axis; one of: a, b"):
        plot_panels.panels(crossed, "c")
    # records written before records held their axes are given them when loaded
    for name, recs in one.items():
        for rec in recs:
            path = tmp_path / "older" / "results" / name / f"seed={rec['seed']}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(rec if name != "lr=0" else
                                       {k: v for k, v in rec.items() if k != "axes"}))
    older = report.by_variant(report.load(str(tmp_path / "older")), list(one))
    assert list(plot_panels.panels(older)["1 of 2"]) == list(plot_panels.panels(one)["1 of 2"])
    assert list(plot_panels.panels(older)["1 of 2"])[:2] == ["0", "1"]
    xs, means, lows, highs = plots.series(one["lr=1"], "eval/loss", lambda p: p["step"])
    assert xs == [2, 4] and lows == [1.5, 1.0] and highs == [1.7, 1.2]
    assert means == pytest.approx([1.6, 1.1], rel=1e-15)
    assert not math.isnan(sum(means))


def _point(**values):
    return tuple(values.items())


def test_the_searches_walk_one_axis_at_a_time_and_widen_past_an_edge():
    """`search.walk` replayed from scores: the coordinate search runs the first axis's line
    from the middle of every axis, then each next axis at the best so far; an edge winner
    gets one more value a geometric step past it (at most W a side, a refused value
    ends it); the grid search runs the product, and a widened axis adds its slice."""
    lr = tune.Axis("learning_rate", ("0.001", "0.003", "0.01"))
    outer = tune.Axis("aggregation.outer_lr", ("0.5", "0.7", "1.0"))
    momentum = tune.Axis("aggregation.outer_momentum", ("0.8", "0.9"))

    def loss(point):  # best at lr 0.05 (past the grid), outer 0.7, momentum 0.8, adam
        v = {k: float(x) if k != "optimizer" else x for k, x in point}
        return (0.1 * (v.get("optimizer") == "sgd") + (math.log10(v["learning_rate"] / 0.05)) ** 2
                + (v.get("aggregation.outer_lr", 0.7) - 0.7) ** 2
                + (v.get("aggregation.outer_momentum", 0.8) - 0.8) ** 2)

    def replay(axes, kind, widen, allowed=lambda p: True, broken=()):
        """Runs each walk's pending points (as the runner's rounds) until it chooses."""
        done, rounds = {}, []
        while True:
            found = search.walk(axes, lambda p: done.get(p, tune.MISSING), True, kind,
                                widen, allowed)
            if not found.pending:
                return found, rounds
            rounds.append(found.pending)
            done.update({p: None if p in broken else loss(p) for p in found.pending})

    found, rounds = replay([lr, outer, momentum], "coordinate", 2)
    mid = dict(learning_rate="0.003", **{"aggregation.outer_lr": "0.7",
                                        "aggregation.outer_momentum": "0.9"})
    at = lambda **kw: _point(**{**mid, **kw})
    assert rounds == [
        [at(learning_rate=v) for v in ("0.001", "0.003", "0.01")],
        [at(learning_rate="0.0333")],  # 0.01 at the edge: 0.01 * 0.01 / 0.003
        [at(learning_rate="0.111")],  # 0.0333 at the edge again: the second widening
        [at(learning_rate="0.0333", **{"aggregation.outer_lr": v}) for v in ("0.5", "1.0")],
        [at(learning_rate="0.0333", **{"aggregation.outer_momentum": "0.8"})],
        [at(learning_rate="0.0333", **{"aggregation.outer_momentum": "0.711"})]]
    assert found.chosen == at(learning_rate="0.0333", **{"aggregation.outer_momentum": "0.8"})
    assert len(found.tried) == 9 == len(set(found.tried))  # against 18 in the product
    assert min(found.tried, key=loss) == found.chosen
    rows = [{"values": dict(p)} for p in found.tried]
    assert tune.at_edge(rows, dict(found.chosen)) == {}

    once, _ = replay([lr], "coordinate", 1)  # one widening: 0.0333 stays at the edge
    assert once.chosen == _point(learning_rate="0.0333")
    assert tune.at_edge([{"values": dict(p)} for p in once.tried],
                        dict(once.chosen)) == {"learning_rate": "highest"}
    refused, rounds = replay([lr], "coordinate", 2,
                             allowed=lambda p: float(p[0][1]) < 0.02)
    assert len(rounds) == 1 and refused.chosen == _point(learning_rate="0.01")
    diverged, rounds = replay([lr], "coordinate", 2, broken={_point(learning_rate="0.0333")})
    assert len(rounds) == 2 and diverged.chosen == _point(learning_rate="0.01")

    name = tune.Axis("optimizer", ("adam", "sgd"))  # not numeric: never widened
    product, rounds = replay([lr, name], "grid", 1)
    assert [len(r) for r in rounds] == [6, 2]  # the grid, then the slice at lr 0.0333
    assert product.chosen == _point(learning_rate="0.0333", optimizer="adam")
    assert search.walk([lr], lambda p: tune.MISSING, True).pending == [
        _point(learning_rate=v) for v in lr.values]
    last_first = search.walk([lr], lambda p: 1.0 if p[0][1] == "0.01" else tune.MISSING,
                             True, "coordinate")  # a line's cells finished out of order
    assert last_first.tried == [_point(learning_rate="0.01")]
    assert last_first.reached == [_point(learning_rate=v) for v in lr.values]


def test_a_second_pass_tunes_the_first_axis_again_at_the_others_best():
    """--tune_passes=2: the inner rate, tuned first at the middle outer rate (where a method
    is unstable and wants a small rate), is tuned again at the outer rate the first pass
    chose, and the outer rate again at that; a line runs only its points not yet run, and a
    third pass that would run nothing new changes nothing."""
    lr = tune.Axis("learning_rate", ("0.001", "0.003", "0.01"))
    outer = tune.Axis("aggregation.outer_lr", ("0.3", "0.5", "0.7"))
    table = {("0.001", "0.5"): 5, ("0.003", "0.5"): 6, ("0.01", "0.5"): 7,
             ("0.001", "0.3"): 4, ("0.001", "0.7"): 9,
             ("0.003", "0.3"): 3, ("0.01", "0.3"): 2, ("0.01", "0.7"): 8}
    at = lambda rate, outer_lr: _point(**{"learning_rate": rate,  # noqa: E731
                                          "aggregation.outer_lr": outer_lr})
    chosen = {}
    for passes in (1, 2, 3):
        done, rounds = {}, []
        while True:
            found = search.walk([lr, outer], lambda p: done.get(p, tune.MISSING), True,
                                "coordinate", 0, passes=passes)
            if not found.pending:
                break
            rounds.append(found.pending)
            done.update({p: table[(p[0][1], p[1][1])] for p in found.pending})
        chosen[passes] = found.chosen
        if passes == 2:
            assert rounds == [[at(v, "0.5") for v in ("0.001", "0.003", "0.01")],
                              [at("0.001", "0.3"), at("0.001", "0.7")],
                              [at("0.003", "0.3"), at("0.01", "0.3")],
                              [at("0.01", "0.7")]]
            assert found.reached[:5] == [at(v, "0.5") for v in ("0.001", "0.003", "0.01")] + [
                at("0.001", "0.3"), at("0.001", "0.7")]  # the first pass's order kept
    assert chosen == {1: at("0.001", "0.3"), 2: at("0.01", "0.3"), 3: at("0.01", "0.3")}


def test_a_momentum_at_its_top_edge_widens_toward_1_geometrically_in_1_minus_m():
    """A step past 0.95 of (0.8, 0.9, 0.95) would be 1.003, which a momentum's Config
    refuses: the widening steps in 1 - m instead (0.05 -> 0.025 -> 0.0125), while an axis
    that may pass 1 (an outer rate of 0.3, 0.6) keeps its plain geometric step."""
    momentum = tune.Axis("aggregation.outer_momentum", ("0.8", "0.9", "0.95"))
    below_one = lambda p: float(p[0][1]) < 1  # noqa: E731  (as OptimOptions' range check)
    done, rounds = {}, []
    while True:
        found = search.walk([momentum], lambda p: done.get(p, tune.MISSING), True,
                            "coordinate", 2, below_one)
        if not found.pending:
            break
        rounds.append([p[0][1] for p in found.pending])
        done.update({p: abs(float(p[0][1]) - 0.99) for p in found.pending})
    assert rounds == [["0.8", "0.9", "0.95"], ["0.975"], ["0.9875"]]
    assert found.chosen == _point(**{"aggregation.outer_momentum": "0.9875"})
    rate = tune.Axis("aggregation.outer_lr", ("0.3", "0.6"))
    grown = search.walk([rate], lambda p: -float(p[0][1]), True, "coordinate", 1)
    assert grown.chosen == _point(**{"aggregation.outer_lr": "1.2"})


def test_a_coordinate_sweep_runs_its_rounds_and_records_the_order(tmp_path, monkeypatch,
                                                                 caplog):
    """runner.run with --tune_search=coordinate and --tune_widen: each round runs the
    points the search needs (the cells stubbed: a record whose eval loss is a function of
    the point) and the final cells of each variant whose search has chosen (the ring's
    beside DiLoCo's outer line), a re-run runs nothing, and the records, the final cells'
    tuning summary and the report's table follow the search."""
    plan = plan_lib.Plan(
        vary=("aggregation=ring,diloco:period=2",),
        set=("model=mlp", "dataset=synthetic", "devices=cpu:2", "global_batch_size=8",
             "train_steps=2", "checkpoint_every=0"), seeds=(0,),
        output_dir=str(tmp_path / "sweep"), evals=1,
        tune=("learning_rate=0.01,0.03,0.1", "aggregation.outer_lr=0.5,0.7,1.0"),
        tune_search="coordinate", tune_widen=1)

    def loss(cell):  # best at learning rate 0.03, outer rate 1.0 (an edge: widened once)
        v = {k: float(x) for k, x in cell.point}
        return (abs(math.log10(v["learning_rate"] / 0.03))
                + abs(v.get("aggregation.outer_lr", 1.0) - 1.5))

    rounds = []

    def run_chunk(plan, cells, towers, stop):
        rounds.extend([[(c.variant.name, c.point, *([] if c.tuning else ["final"]))
                        for c in cells]] if cells else [])
        for cell in cells:
            rec = {"variant": cell.variant.name, "seed": cell.seed, "axes": [],
                   "tuned": dict(cell.point), "phase": "tuning" if cell.tuning else "final",
                   "target": None, "diverged": None, "curve": [{"step": 2,
                                                                "eval/loss": loss(cell)}]}
            runner._add_tuning(plan, cell, rec)
            record.write(plan.result_path(cell), rec)

    monkeypatch.setattr(runner, "run_chunk", run_chunk)
    paths = runner.run(plan)
    lr = lambda v: ("learning_rate", v)
    olr = lambda v: ("aggregation.outer_lr", v)
    diloco = "aggregation=diloco:period=2"
    assert rounds == [
        [("aggregation=ring", (lr(v),)) for v in ("0.01", "0.03", "0.1")]
        + [(diloco, (lr(v), olr("0.7"))) for v in ("0.01", "0.03", "0.1")],
        [(diloco, (lr("0.03"), olr(v))) for v in ("0.5", "1.0")]
        + [("aggregation=ring", (lr("0.03"),), "final")],  # its search has chosen
        [(diloco, (lr("0.03"), olr("1.43")))],  # 1.0 at the edge: 1.0 * 1.0 / 0.7
        [(diloco, (lr("0.03"), olr("1.43")), "final")]]
    # the least the search runs (the start line's count): ring's line 3, diloco's 3 + 2
    tuned = [cell for cell in rounds[0] + rounds[1] if "final" not in cell]
    assert search.least_tuning_cells(plan) == 8 == len(tuned)
    finals = [record.read(p) for p in paths]
    assert [f["tuned"] for f in finals] == [{"learning_rate": "0.03"},
                                            {"learning_rate": "0.03",
                                             "aggregation.outer_lr": "1.43"}]
    assert finals[1]["tuning"]["search"] == "coordinate"
    assert finals[1]["tuning"]["at_edge"] == {"aggregation.outer_lr": "highest"}
    assert [row["values"]["aggregation.outer_lr"] for row in finals[1]["tuning"]["tried"]] == [
        "0.7", "0.7", "0.7", "0.5", "1.0", "1.43"]
    indices = sorted(record.read(plan.result_path(c))["tune_index"]
                     for v in plan.variants() if v.name == diloco
                     for c in [plan_lib.Cell(v, 1000, p, tuning=True)
                               for p in search.order_of(plan, v)])
    assert indices == list(range(6))
    with pytest.raises(grid.SpecError, match=r"^--tune_search=random: give one of grid, "
                                              r"coordinate$"):
        dataclasses.replace(plan, tune_search="random").variants()
    count = len(rounds)
    with caplog.at_level("WARNING"):
        runner.run(plan)  # nothing left
    assert len(rounds) == count
    assert ("variant aggregation=diloco:period=2's chosen learning_rate=0.03,"
            "aggregation.outer_lr=1.43 lies at the grid's highest aggregation.outer_lr"
            in caplog.text)  # the edge said once every final has run
    text = "\n".join(tuning_report.section(plan.output_dir, [v.name for v in plan.variants()]))
    assert "one axis at a time" in text and "up to 1 times a side" in text
    assert text.count("**chosen**") == 2 and "`aggregation.outer_lr`: widen" in text

    # widened once more on a re-run: 2.04 is tried and 1.43 stays the choice, inside now;
    # the final record is kept (nothing runs) with its tuning summary brought up to date
    wider = dataclasses.replace(plan, tune_widen=2)
    runner.run(wider)
    assert rounds[-1] == [(diloco, (lr("0.03"), olr("2.04")))]
    again = record.read(paths[1])
    assert again["curve"] == finals[1]["curve"] and again["tuned"] == finals[1]["tuned"]
    assert again["tuning"]["at_edge"] == {} and again["tuning"]["widen"] == 2
    assert again["tuning"]["tried"][-1]["values"]["aggregation.outer_lr"] == "2.04"
    # a choice that moves (1.43's tuning record made worse) refuses the stale final seed
    stale = plan_lib.Cell(plan.variants()[1], 1000, (lr("0.03"), olr("1.43")), tuning=True)
    worse = record.read(wider.result_path(stale))
    worse["curve"][-1]["eval/loss"] = 9.0
    record.write(wider.result_path(stale), worse)
    with pytest.raises(ConfigError, match=(
            r"^cell aggregation=diloco:period=2 seed=0: its record .* was trained at "
            r"learning_rate=0.03,aggregation.outer_lr=1.43, but the search now chooses "
            r"learning_rate=0.03,aggregation.outer_lr=1.0; remove it and .* to run")):
        runner.run(wider)
