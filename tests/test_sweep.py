"""The study runner (mgloop/sweep): mean ± sd, the records' bytes and modelled time, resume,
one build at a time, the report's table and plots, the command line."""

import gc
import json
import math
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

from mgloop.runs import callbacks
from mgloop.errors import ConfigError
from mgloop.runs.sweep import grid
from mgloop.runs.sweep import plan as plan_lib
from mgloop.runs.sweep import record
from mgloop.runs.sweep import report
from mgloop.runs.sweep import target as target_lib
from mgloop.runs.sweep import runner
from mgloop.aggregation.traffic import Occasion, Traffic
from mgloop.observe import link_model, link_report, stats
from tests import tensorboard_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mean_and_sample_sd_over_seeds():
    mean, sd, n = stats.mean_sd([1.0, 2.0, None, 3.0, float("nan"), 4.0])
    assert n == 4 and mean == 2.5
    assert sd == pytest.approx(math.sqrt(((1.5 ** 2) * 2 + (0.5 ** 2) * 2) / 3), rel=1e-15)
    assert stats.mean_sd([7.0]) == (7.0, None, 1)
    assert stats.mean_sd([None]) == (None, None, 0)
    values = [0.912, 0.905, 0.921]
    assert stats.mean_sd(values)[1] == pytest.approx(np.std(values, ddof=1), rel=1e-12)
    assert stats.text([1.0, 2.0, 3.0, 4.0]) == "2.5 ± 1.3"
    assert stats.text([0.9123, 0.9170, 0.9076]) == "0.9123 ± 0.0047"
    assert stats.text([40, 40]) == "40 ± 0"
    # values equal up to float rounding (the mean of three 0.1s is not 0.1; a value one ulp
    # apart): a spread of 0, not ~1e-17 printed to 18 decimals
    assert math.fsum([0.1] * 3) / 3 != 0.1
    for equal in ([0.1] * 3, [0.39743568, math.nextafter(0.39743568, 1), 0.39743568]):
        assert stats.mean_sd(equal)[1] == 0.0 and stats.text(equal) in ("0.1 ± 0",
                                                                         "0.3974 ± 0")
    assert stats.text([]) == "—"
    assert stats.text([2e6, 4e6], scale=1e6) == "3.0 ± 1.4"


class _Result:
    """A RunResult's parts that a record reads: the summary, the History, the traffic."""

    def __init__(self, summary, records, traffic=None):
        self.summary = summary
        self.history = callbacks.History()
        for rec in records:
            self.history(rec["step"], {k: v for k, v in rec.items() if k != "step"})
        aggregation = types.SimpleNamespace(traffic=traffic or Traffic())
        self.trainer = types.SimpleNamespace(aggregation=aggregation)


LINKS = ["within:100gbit,2us", "between:1gbit,50us"]


def _local_traffic(gradient=1000, state=8, period=4):
    """Two nodes (one device each): `state` bytes every step, `gradient` bytes each way
    on the steps that close a period of `period` (a local method's sync)."""
    traffic = Traffic(node_of={"CPU:0": 0, "CPU:1": 1})
    with traffic.counting_state():
        traffic.record("CPU:0", "CPU:1", state)
    with traffic.on(Occasion("sync", lambda s: (s + 1) % period == 0)):
        traffic.record("CPU:0", "CPU:1", gradient)
        traffic.record("CPU:1", "CPU:0", gradient)
    return traffic


def _summary(traffic, compute=0.01, final=40):
    report = link_report.report(link_report.Schedule(traffic, final),
                                [link_model.parse(t) for t in LINKS], compute,
                                gradient_bytes=4000, num_nodes=2)
    return {"final_step": final, "stopped_by": None, "eval_metrics": {"accuracy": 0.8},
            "config": {"links": LINKS}, "link_model": report}


def test_record_counts_bytes_and_modelled_seconds_of_the_steps_that_send():
    """gradient bytes through s = n(s) G (n(s) = floor(s / 4) syncs), state bytes = s S,
    seconds = s C + sum of the modelled exchange of each step; the last point's bytes per
    step are summary.json's; time to target is the first eval meeting it."""
    records = [{"step": 10, "eval/loss": 2.0, "eval/accuracy": 0.4},
               {"step": 20, "train/loss": 1.0},  # no eval: not a point of the curve
               {"step": 30, "eval/loss": 1.0, "eval/accuracy": 0.75}]
    traffic = _local_traffic()
    result = _Result(_summary(traffic), records, traffic)
    target = target_lib.parse_target("accuracy>=0.7")
    curve = record.curve_of(result)
    assert [p["step"] for p in curve] == [10, 30, 40]  # and the final eval from the summary
    assert [p["gradient_bytes"] for p in curve] == [2 * 1000, 7 * 1000, 10 * 1000]
    assert [p["state_bytes"] for p in curve] == [80, 240, 320]
    within, between = map(link_model.parse, LINKS)
    quiet = link_model.tiered_exchange_seconds(traffic.at_step(0), within, between)
    sync = link_model.tiered_exchange_seconds(traffic.at_step(3), within, between)
    assert sync == pytest.approx(2 * 50e-6 + 1008 / 1.25e8)  # two messages: state, gradient
    assert quiet == pytest.approx(50e-6 + 8 / 1.25e8)
    assert curve[1]["seconds"]["between_1gbit_50us"] == pytest.approx(
        30 * 0.01 + 7 * sync + 23 * quiet)
    summary = result.summary["link_model"]
    assert summary["gradient_bytes_per_step"] == curve[-1]["gradient_bytes"] / 40 == 250
    assert summary["compression_ratio"] == 4000 / 250  # a dense ring between 2 nodes: G
    assert summary["syncs"]["sync"]["occurrences"] == 10
    assert summary["syncs"]["sync"]["compression_ratio"] == 4.0
    assert summary["links"]["between_1gbit_50us"]["exchange_seconds"] == pytest.approx(
        (10 * sync + 30 * quiet) / 40)
    assert curve[2]["eval/accuracy"] == 0.8
    assert record.time_to_target(curve, target) == {
        "step": 30, "gradient_bytes": 7000, "seconds": curve[1]["seconds"]}
    assert record.time_to_target(curve, target_lib.parse_target("loss<=0.5")) is None
    cell = plan_lib.Cell(grid.Variant("aggregation=randomk", {}, {}, (("aggregation", "randomk"),)), 0)
    seen = _Result({}, [{"step": 10, "eval/loss": 2.0, "eval/accuracy": 0.75},
                        {"step": 20, "train/loss": float("nan")}]).history
    lost = record.diverged_record(cell, seen, "nan", target)
    assert lost["diverged"] == "nan" and [p["step"] for p in lost["curve"]] == [10]
    assert lost["time_to_target"]["step"] == 10
    assert record.traffic_of(result.summary)["gradient_bytes_per_step"] == 250


def test_targets_and_variant_folders_are_parsed_or_refused():
    target = target_lib.parse_target("eval/perplexity <= 3.5")
    assert (target.metric, target.comparison, target.value) == ("perplexity", "<=", 3.5)
    assert target.met(3.5) and not target.met(3.6) and not target.met(float("nan"))
    for bad in ("accuracy>0.9", "accuracy>=high", ">=0.9"):
        with pytest.raises(grid.SpecError, match="--target"):
            target_lib.parse_target(bad)
    names = ["aggregation=topk:ratio=0.01", "aggregation=topk_ratio=0.01"]
    folders = [plan_lib.variant_folder(n) for n in names]
    assert len(set(folders)) == 2 and all("/" not in f and ":" not in f for f in folders)


def _plan(tmp_path, **overrides):
    settings = dict(vary=("learning_rate=0.05,0.1",),
                    set=("model=mlp", "dataset=synthetic", "devices=cpu:2",
                         "global_batch_size=32", "train_steps=4", "checkpoint_every=0"),
                    seeds=(0, 1), output_dir=str(tmp_path / "sweep"), evals=2,
                    target=target_lib.parse_target("accuracy>=0.0"))
    settings.update(overrides)
    return plan_lib.Plan(**settings)


def test_a_bad_cell_is_refused_before_any_cell_runs(tmp_path):
    plan = _plan(tmp_path, vary=("global_batch_size=32,33",),
                 set=("model=mlp", "devices=cpu:2", "train_steps=4"))
    with pytest.raises(ConfigError, match=r"cell global_batch_size=33 seed=0: "
                                          r"--global_batch_size=33 does not split"):
        runner.run(plan)
    assert not os.path.exists(plan.output_dir)  # validation makes no folder
    for epochs in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(grid.SpecError, match=f"--epochs={epochs}: give a finite number"):
            _plan(tmp_path, epochs=epochs).cells()
    with pytest.raises(ConfigError, match="--epochs=E or --set=train_steps=S"):
        unbounded = _plan(tmp_path, set=("devices=cpu:2",))
        unbounded.config(unbounded.cells()[0])


def test_a_target_metric_a_cell_does_not_report_is_refused_before_any_folder(tmp_path):
    """A --target metric that is a typo, or that the cell's model does not report (a
    classifier has no perplexity), is refused in one line naming the cell and the metrics
    it reports, before any cell runs or any folder is made: through the plan (runner.run)
    and the command line (`python -m mgloop.sweep`, exit 2); a language model's perplexity
    is taken."""
    digits = ("model=mlp", "dataset=digits", "devices=cpu:2", "train_steps=2")
    for target, sets in (("perplxity<=30", _plan(tmp_path).set), ("perplexity<=30", digits)):
        plan = _plan(tmp_path, vary=("learning_rate=0.001,0.003",), set=sets,
                     target=target_lib.parse_target(target))
        dataset = "digits" if sets is digits else "synthetic"
        with pytest.raises(ConfigError, match=(
                rf"^cell learning_rate=0.001 seed=0: --target={target}: --model=mlp on "
                rf"--dataset={dataset} reports no eval {target[:-4]}; give METRIC>=V or "
                r"METRIC<=V of one it reports: loss, accuracy$")):
            runner.run(plan)
        assert not os.path.exists(plan.output_dir)
    lm = _plan(tmp_path, vary=(), target=target_lib.parse_target("perplexity<=30"),
               set=("model=transformer_lm", "dataset=python_text", "sequence_length=8",
                    "lm_layers=1", "lm_width=8", "lm_heads=1", "devices=cpu:1",
                    "train_steps=2"))
    assert lm.config(lm.cells()[0]).model == "transformer_lm"
    assert plan_lib.eval_metrics(lm.config(lm.cells()[0])) == ("loss", "accuracy",
                                                               "perplexity")

    from tests import test_refusals  # its helper: sweep rows in one process, one TF start
    rows = [[f"--output_dir={tmp_path / name}", "--seeds=1", "--vary=learning_rate=0.001,0.003",
             f"--target={target}", *[f"--set={item}" for item in digits]]
            for name, target in (("typo", "perplxity<=30"), ("classifier", "perplexity<=30"))]
    done = subprocess.run([sys.executable, "-m", "tests.test_refusals", json.dumps(rows)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for (code, stderr), metric in zip(results, ("perplxity", "perplexity")):
        assert code == 2, stderr[-2000:]
        assert test_refusals.error_line(stderr, "sweep") == (
            f"cell learning_rate=0.001 seed=0: --target={metric}<=30: --model=mlp on "
            f"--dataset=digits reports no eval {metric}; give METRIC>=V or METRIC<=V of one "
            "it reports: loss, accuracy")
    assert not (tmp_path / "typo").exists() and not (tmp_path / "classifier").exists()


def test_the_eval_metrics_a_cell_reports_are_its_trainers(tmp_path):
    """plan.eval_metrics (what --target is checked against) names the metrics a built
    Trainer of the cell's Config evaluates: a classifier's and a language model's; a cell
    of a dataset without eval data is refused."""
    from mgloop import data
    from mgloop.runs import config as config_lib
    from mgloop.runs import prepare
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("the quick brown fox jumps over the dog; " * 20)
    for settings, reported in (
            (dict(model="mlp", dataset="synthetic"), ("loss", "accuracy")),
            (dict(model="transformer_lm", dataset="text", data_dir=str(tmp_path / "text"),
                  sequence_length=8, lm_layers=1, lm_width=8, lm_heads=1),
             ("loss", "accuracy", "perplexity"))):
        config = config_lib.Config(devices="cpu:1", train_steps=2, global_batch_size=8,
                                   logdir=str(tmp_path / "run"), **settings)
        dataset = data.load(config.dataset, 0, config.data_dir,
                            data.sequence_length_of(config.data))
        trainer = prepare.trainer_for(config, dataset)  # validates it
        assert plan_lib.eval_metrics(config) == reported
        assert reported == ("loss", *[m.name for m in trainer.metrics])
    # a --plugin dataset registered without eval data: its cells report nothing to compare
    data.register("sweep_test_stream_without_eval", _no_stream, num_classes=3)
    plan = _plan(tmp_path, vary=(), target=None, set=(
        "dataset=sweep_test_stream_without_eval", f"data_dir={tmp_path}", "devices=cpu:1",
        "train_steps=2"))
    with pytest.raises(ConfigError, match="^cell default seed=0: --dataset=sweep_test_stream_"
                                          "without_eval has no eval data, so the cell reports "
                                          "no eval metric to compare; register the dataset "
                                          "with eval="):
        plan.config(plan.cells()[0])


def _no_stream(data_dir, input_context):
    return None  # never read: the plan is refused before


def test_sweep_resumes_holds_one_build_and_reports(tmp_path):
    """4 cells in this process; no Trainer outlives its cell; TensorBoard shows each cell
    as an HParams session (a real server); a re-run skips the finished cells, takes a cell
    that has a checkpoint from there, starts one without afresh; the report has a row per
    variant and readable plots."""
    from mgloop.runs import trainer
    plan = _plan(tmp_path)
    cells = plan.cells()
    paths = runner.run(plan)
    gc.collect()
    assert not [o for o in gc.get_objects() if isinstance(o, trainer.Trainer)]
    assert [os.path.exists(p) for p in paths] == [True] * 4
    first = record.read(paths[0])
    assert first["seed"] == 0 and first["final_step"] == 4
    assert [p["step"] for p in first["curve"]] == [2, 4]
    assert first["time_to_target"]["step"] == 2  # accuracy >= 0 at the first eval
    assert first["traffic"]["gradient_bytes_per_step"] > 0

    stamps = {p: os.stat(p).st_mtime_ns for p in paths}
    last = record.read(paths[3])
    os.remove(paths[3])  # the last cell ended but its record was not written: it resumes
    shutil.rmtree(plan.logdir(cells[2]) + "/checkpoints")  # no checkpoint: starts afresh
    os.remove(paths[2])
    junk = os.path.join(plan.logdir(cells[2]), "half-written")
    with open(junk, "w") as handle:
        handle.write("x")
    assert runner.pending(plan, cells) == cells[2:]
    runner.run(plan)
    assert [os.stat(p).st_mtime_ns == stamps[p] for p in paths[:2]] == [True] * 2
    assert os.path.exists(paths[2]) and not os.path.exists(junk)
    again = record.read(paths[3])  # from its checkpoint at step 4 and its kept evals
    assert [(p["step"], p["eval/loss"]) for p in again["curve"]] == [
        (p["step"], p["eval/loss"]) for p in last["curve"]]

    request = {"experimentName": "", "startIndex": 0, "sliceSize": 10,
               "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS"],
               "colParams": [{"hparam": "learning_rate"}, {"hparam": "seed"}]}
    with tensorboard_server.serve(os.path.join(plan.output_dir, "runs")) as board:
        groups = board.wait_for(
            lambda s: sum(len(g["sessions"]) for g in s.get("sessionGroups", [])) == 4,
            "/data/plugin/hparams/session_groups", body=request)["sessionGroups"]
    assert sorted((g["hparams"]["learning_rate"], sorted(x["name"].split("/")[0]
                                                         for x in g["sessions"]))
                  for g in groups) == [(0.05, ["seed=0", "seed=1"]), (0.1, ["seed=0", "seed=1"])]

    order = [c.variant.name for c in cells[::2]]
    path = report.write(plan.output_dir, order, "test sweep")
    text = open(path).read()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == order
    assert all(" ± " in r and "| 2/2 |" in r for r in rows)
    # a target given after the cells ran (the sweep's --target, then --report_only): each
    # record's time to target is read from its curve again
    never = target_lib.parse_target("loss<=-1")
    again = open(report.write(plan.output_dir, order, "test sweep", target=never)).read()
    assert "target: loss<=-1;" in again
    assert all("| 0/2 |" in line for line in again.splitlines() if line.startswith("| `"))
    from matplotlib import image
    for name in ("metric_vs_steps.png", "metric_vs_bytes.png"):
        pixels = image.imread(os.path.join(plan.output_dir, "plots", name))
        assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 300
        assert np.ptp(pixels[..., :3]) > 0.5  # lines drawn, not a blank canvas


def test_command_line_runs_cells_in_worker_processes_and_refuses_bad_flags(tmp_path):
    """`python -m mgloop.sweep`: two cells in one spawned worker process, the report;
    bad settings exit 2 with one line before anything runs."""
    out = tmp_path / "cli"
    base = [sys.executable, "-m", "mgloop.sweep", f"--output_dir={out}", "--seeds=1",
            "--set=model=mlp", "--set=dataset=synthetic", "--set=devices=cpu:2",
            "--set=train_steps=2", "--set=checkpoint_every=0", "--evals=1"]
    bad = subprocess.run(base + ["--vary=learning_rate=fast"], capture_output=True,
                         text=True, cwd=REPO, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1] == (
        "mgloop.sweep: error: --vary learning_rate: 'fast' is not a float")
    assert not out.exists()
    done = subprocess.run(base + ["--vary=aggregation=ring,ps_cpu", "--processes=1",
                                  "--cells_per_process=2", "--link=1gbit,50us"],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    records = report.load(str(out))
    assert sorted(r["variant"] for r in records) == ["aggregation=ps_cpu", "aggregation=ring"]
    assert all(r["curve"][-1]["seconds"]["1gbit_50us"] > 0 for r in records)
    text = (out / "report.md").read_text()
    assert "python -m mgloop.sweep" in text and "metric_vs_seconds_1gbit_50us.png" in text
    assert os.path.exists(out / "plots" / "metric_vs_seconds_1gbit_50us.png")
    assert json.loads(json.dumps(records))  # plain JSON


def test_two_axes_give_a_pivot_table_and_plots_per_column(tmp_path):
    """Hand-made records of a 2 x 2 grid (aggregation x attack), 2 seeds: the pivot has
    the last axis as columns, its cells mean ± sd of the final metric; one plot per x
    axis (its 4 curves in one panel: tests/test_sweep_tune.py counts the panels)."""
    out = tmp_path / "pivot"
    for agg, attack, base in (("median", "none", 0.9), ("median", "alie", 0.5),
                              ("krum", "none", 0.8), ("krum", "alie", 0.7)):
        for seed, shift in ((0, 0.0), (1, 0.02)):
            name = f"aggregation={agg},attack={attack}"
            curve = [{"step": s, "eval/accuracy": base * s / 4 + shift, "eval/loss": 1.0,
                      "gradient_bytes": 100 * s, "state_bytes": 0, "seconds": {}}
                     for s in (2, 4)]
            rec = {"variant": name, "seed": seed, "axes": [["aggregation", agg],
                                                           ["attack", attack]],
                   "curve": curve, "traffic": {"where": "between nodes"}, "target": None,
                   "time_to_target": None}
            record.write(str(out / "results" / plan_lib.variant_folder(name)
                             / f"seed={seed}.json"), rec)
    order = [f"aggregation={a},attack={b}" for a in ("median", "krum") for b in ("none", "alie")]
    text = open(report.write(str(out), order, "pivot")).read()
    assert "| aggregation | `none` | `alie` |" in text
    assert "| `median` | 0.910 ± 0.014 | 0.510 ± 0.014 |" in text
    assert "| `krum` | 0.810 ± 0.014 | 0.710 ± 0.014 |" in text
    pngs = sorted(os.listdir(out / "plots"))
    assert pngs == ["metric_vs_bytes.png", "metric_vs_steps.png"]
