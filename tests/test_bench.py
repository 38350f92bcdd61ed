"""experiments/bench.py end to end in a tiny configuration: one one-process system and two
multi-worker systems (2 processes each), one step per loop; and its refusals before any process
starts.

The end-to-end run is also the equivalence test of the MultiWorkerMirroredStrategy baseline
(its processes are the harness's, started once): from the seed's weights on the same batches,
its loss on one step, and on each of the next two steps (which depend on the updates before
them), equals mgloop's across workers and MirroredStrategy's."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from experiments import bench_plan
from tests import helpers
from tests import tensorboard_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MGLOOP_MODES = {"ring": False, "ps_cpu": False, "colocate": True}
ONE_PROCESS = {"mirrored_ctl@2"}
MULTI_WORKER = {"mgloop:ring@2x1", "multi_worker_mirrored@2x1"}


def test_harness_runs_and_its_outputs_parse(tmp_path):
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.bench", "--models=mlp",
         "--towers=2", "--modes=mirrored_ctl,ring@2x1,multi_worker_mirrored@2x1",
         "--steps=1", "--warmup=1", "--repeats=2",
         f"--output_dir={out}"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    payload = json.loads((out / "bench.json").read_text())
    assert payload["settings"]["steps"] == 1 and payload["machine"]["cpus"] >= 1
    (model,) = payload["results"]
    rows = {row["name"]: row for row in model["rows"]}
    assert set(rows) == ONE_PROCESS | MULTI_WORKER
    for row in rows.values():
        assert len(row["step_ms_repeats"]) == 2 and row["examples_per_sec"] > 0
        per_repeat = [model["global_batch"] / (ms / 1e3) for ms in row["step_ms_repeats"]]
        assert abs(row["examples_per_sec"] - float(np.median(per_repeat))) < 1e-6
        # TensorFlow is resident in each of the system's processes
        assert row["peak_rss_mib"] >= row["baseline_rss_mib"] > 50 * row["workers"]
        assert len(row["loop_losses"]) == 3 and row["first_loop_loss"] == row["loop_losses"][0]
    # MultiWorkerMirroredStrategy computes what mgloop computes across 2 workers (and what
    # MirroredStrategy computes): the same loss on the first step from the seed's weights, and
    # on the next two, after the same updates; each within the float32 bound of the one-device
    # run of those 3 steps (tests/tolerance.py; each step's within the sum), so within twice it
    bound = helpers.bound_of_run(helpers.small_config(
        str(tmp_path / "bound"), model=model["model"], dataset=model["dataset"],
        global_batch_size=model["global_batch"], optimizer="momentum", learning_rate=0.01,
        seed=0, train_steps=3, deterministic=False), 3).loss_sum
    mgloop, mwms = rows["mgloop:ring@2x1"], rows["multi_worker_mirrored@2x1"]
    for other in (mwms, rows["mirrored_ctl@2"]):
        assert np.abs(np.subtract(other["loop_losses"], mgloop["loop_losses"])).max() <= 2 * bound
    assert len(set(mgloop["loop_losses"])) == 3  # the steps differ: the test could fail
    # the split each system ran on, read back from its processes
    assert [row["split"] for row in rows.values()] == ["1x2", "2x1", "2x1"]
    assert mwms["devices"] == [["/job:worker/replica:0/task:0/device:CPU:0"],
                               ["/job:worker/replica:0/task:1/device:CPU:0"]]
    assert [len(d) for d in mgloop["devices"]] == [1, 1]
    assert all(f"task:{i}/" in name for i, names in enumerate(mgloop["devices"])
               for name in names)
    assert rows["mirrored_ctl@2"]["step_ratio_to_mirrored"] == 1.0
    for row in (mgloop, mwms):  # 2 towers in all, as mirrored_ctl@2
        ratio = row["step_ms"] / rows["mirrored_ctl@2"]["step_ms"]
        assert abs(row["step_ratio_to_mirrored"] - ratio) < 1e-12
    assert mwms["step_ratio_to_multi_worker_mirrored"] == 1.0
    ratio = mgloop["step_ms"] / mwms["step_ms"]
    assert abs(mgloop["step_ratio_to_multi_worker_mirrored"] - ratio) < 1e-12
    assert rows["mirrored_ctl@2"]["step_ratio_to_multi_worker_mirrored"] is None
    table = (out / "bench.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| system"))
    body = [line for line in table.splitlines() if line.startswith("| mgloop:ring@2x1")]
    assert len(body) == 1 and body[0].count("|") == header.count("|")
    mwms = [line for line in table.splitlines() if line.startswith("| multi_worker_mirrored@2x1")]
    assert len(mwms) == 1 and mwms[0].split("|")[2].strip() == "2x1"
    with tensorboard_server.serve(str(out / "tensorboard")) as board:
        tags = board.wait_for(lambda t: len(t) == 3, "/data/plugin/scalars/tags")
        assert set(tags) == {"mlp/mirrored_ctl_2", "mlp/mgloop_ring_2x1",
                             "mlp/multi_worker_mirrored_2x1"}
        (_, _, eps), = board.scalars("mlp/mirrored_ctl_2", "examples_per_sec")
        assert abs(eps - rows["mirrored_ctl@2"]["examples_per_sec"]) < 1e-3 * eps
        request = {"experimentName": "", "startIndex": 0, "sliceSize": 10,
                   "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS"],
                   "colParams": [{"hparam": "system"}, {"hparam": "towers"},
                                 {"hparam": "workers"},
                                 {"metric": {"tag": "examples_per_sec"}}]}
        sessions = board.wait_for(lambda s: len(s.get("sessionGroups", [])) == 3,
                                  "/data/plugin/hparams/session_groups", body=request)
        systems = {(group["hparams"]["system"], group["hparams"]["workers"])
                   for group in sessions["sessionGroups"]}
        assert systems == {("mirrored_ctl", 1), ("mgloop:ring", 2), ("multi_worker_mirrored", 2)}


def test_a_plugin_method_is_benchmarked_in_the_workers(tmp_path):
    """--plugin reaches the harness (its method is a valid --modes entry) and every worker
    (which builds it): the plugin's copy of ps_cpu computes what ps_cpu computes."""
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.bench", "--models=mlp",
         "--towers=2", "--modes=ps_cpu,ps_cpu_copy", "--plugin=tests.plugins.bench_plugin",
         "--steps=1", "--warmup=1", "--repeats=1", "--link=10gbit,10us", f"--output_dir={out}"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    payload = json.loads((out / "bench.json").read_text())
    assert payload["settings"]["plugins"] == ["tests.plugins.bench_plugin"]
    (model,) = payload["results"]
    rows = {row["name"]: row for row in model["rows"]}
    assert set(rows) == {"mgloop:ps_cpu@2", "mgloop:ps_cpu_copy@2"}
    # the same method from the same weights on the same batches: each step's loss within
    # the float32 bound of the one-device run of those 2 steps (tests/tolerance.py), so the
    # two within twice it
    bound = helpers.bound_of_run(helpers.small_config(
        str(tmp_path / "bound"), model=model["model"], dataset=model["dataset"],
        global_batch_size=model["global_batch"], optimizer="momentum", learning_rate=0.01,
        seed=0, train_steps=2, deterministic=False), 2).loss_sum
    copy, original = rows["mgloop:ps_cpu_copy@2"], rows["mgloop:ps_cpu@2"]
    assert len(copy["loop_losses"]) == 2 and copy["examples_per_sec"] > 0
    assert np.abs(np.subtract(copy["loop_losses"], original["loop_losses"])).max() <= 2 * bound
    for row in (copy, original):  # --link: the model of the worker's counted traffic
        sent, messages = row["traffic"]["bytes"], row["traffic"]["messages"]
        expected = max(1e-5 * max(messages[d].values()) + max(sent[d].values()) / 1.25e9
                       for d in sent)
        assert row["link_10gbit_10us_exchange_ms"] == pytest.approx(1e3 * expected, rel=1e-9)
        assert row["link_10gbit_10us_step_ms"] == pytest.approx(row["step_ms"] + 1e3 * expected)
    assert copy["traffic"] == original["traffic"]
    assert "modelled exchange at 10gbit,10us (ms)" in (out / "bench.md").read_text()


def run_language_model(out, *flags):
    """bench.py on the smallest language-model configuration: transformer_lm on
    python_text (sequences of L = 64 tokens), 2 towers of one sequence each, one step per
    loop, mgloop's ring and MirroredStrategy's custom loop."""
    return subprocess.run(
        [sys.executable, "-m", "experiments.bench",
         "--models=transformer_lm", "--dataset=python_text", "--global_batch_size=2",
         "--towers=2", "--modes=ring,mirrored_ctl", "--steps=1", "--warmup=0", "--repeats=1",
         f"--output_dir={out}", *flags],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))


def test_mirrored_loss_is_the_mean_over_every_token(tmp_path):
    """MirroredStrategy's loop takes the mean loss over every token of the global batch, as
    mgloop does (it took the sum over each sequence's tokens: 64 times it): bench.py's
    check of the first step's loss passes, and the two agree within its tolerance."""
    out = tmp_path / "bench"
    result = run_language_model(out)
    assert result.returncode == 0, result.stderr[-3000:]
    (model,) = json.loads((out / "bench.json").read_text())["results"]
    rows = {row["name"]: row for row in model["rows"]}
    mgloop, mirrored = rows["mgloop:ring@2"], rows["mirrored_ctl@2"]
    # at the seed's weights the loss is about log 256 = 5.5 per token, not 64 times it
    assert 4 < mgloop["first_step_loss"] < 8
    # bench.check_first_steps's bound: 2 gamma(n), n a few thousand terms here
    agreement = model["first_step_agreement"]
    assert agreement["rtol"] == pytest.approx(2 * agreement["loss_terms"] * 2.0 ** -24, rel=1e-3)
    assert 1e-5 < agreement["rtol"] < 1e-3
    assert abs(mirrored["first_step_loss"] - mgloop["first_step_loss"]) <= (
        agreement["rtol"] * mgloop["first_step_loss"])


def test_a_system_with_another_loss_is_refused_in_one_line(tmp_path):
    """The old loss of the MirroredStrategy baselines (a sum over the tokens, put back by a
    plugin in the workers) stops bench.py after the first step, with one line naming the
    system, before any timing or output."""
    out = tmp_path / "bench"
    result = run_language_model(out, "--plugin=tests.plugins.token_sum_mirrored")
    assert result.returncode == 1, result.stderr[-3000:]
    assert re.match(r"^bench.py: error: transformer_lm: mirrored_ctl@2 computes another loss: "
                    r"\S+ on its first step .*, mgloop:ring@2 \S+; they must agree within "
                    r"2 gamma\(n\) = \S+ relative \(float32, n = \d+ terms\)$",
                    result.stderr.strip().splitlines()[-1])
    assert not (out / "bench.json").exists()


def test_a_plugin_that_does_not_import_is_one_line(tmp_path):
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.bench",
         "--plugin=tests.plugins.no_such_module", "--modes=ring", f"--output_dir={out}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert result.returncode == 2
    assert re.match(r"^bench.py: error: --plugin=tests.plugins.no_such_module\b.*no_such_module",
                    result.stderr.strip().splitlines()[-1])
    assert not out.exists()  # refused before any worker process started


def test_gpu_without_gpus_fails_at_start_with_one_line(tmp_path):
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.bench", "--device_kind=gpu",
         "--modes=ring,mirrored_ctl", f"--output_dir={out}"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "bench.py: error: --device_kind=gpu: no GPU is visible to TensorFlow on this machine; "
        "use --device_kind=cpu (logical CPU devices)")
    assert not out.exists()  # refused before any worker process started


@pytest.mark.parametrize("modes,error", [
    (["allreduce"], r"^--modes: 'allreduce' is not an mgloop aggregation \(colocate, ps_cpu, "
                    r"ring\) or a baseline \(single_device, .*multi_worker_mirrored\)"),
    (["ring@2y2"], r"^--modes: 'ring@2y2': the part after @ must be T or WxT"),
    (["multi_worker_mirrored"], r"^--modes: 'multi_worker_mirrored': give .* as "
                                r"multi_worker_mirrored@WxT with W >= 2"),
    (["mirrored_ctl@2x2"], r"^--modes: 'mirrored_ctl@2x2': mirrored_ctl runs in one process"),
    (["colocate@2x2"], r"^--modes: 'colocate@2x2': colocate is single-loss"),
    (["ring", "ring@4"], r"^--modes: mgloop:ring@4 would run twice"),
])
def test_bad_modes_are_refused_in_one_line(modes, error):
    with pytest.raises(bench_plan.PlanError, match=error):
        bench_plan.entries(modes, [4], MGLOOP_MODES)


def test_plan_refusals_of_devices_and_batch():
    plan = bench_plan.entries(["ring@2x2", "multi_worker_mirrored@2x2", "single_device"], [4],
                              MGLOOP_MODES)
    assert [(e.name, e.split, e.total_towers) for e in plan] == [
        ("mgloop:ring@2x2", "2x2", 4), ("multi_worker_mirrored@2x2", "2x2", 4),
        ("single_device", "1x1", 1)]
    with pytest.raises(bench_plan.PlanError, match=r"^--modes: multi_worker_mirrored@2x2: "
                       r"without GPUs .* one CPU device per worker .* use "
                       r"multi_worker_mirrored@2x1 \(same global batch\)$"):
        bench_plan.check_devices(plan, "cpu", 0)
    bench_plan.check_devices(plan, "gpu", 4)  # with GPUs, 2 workers x 2 GPUs each
    with pytest.raises(bench_plan.PlanError, match=r"^--device_kind=gpu: mgloop:ring@2x2 needs "
                       r"4 GPUs, 3 visible"):
        bench_plan.check_devices(plan, "gpu", 3)
    with pytest.raises(bench_plan.PlanError, match=r"^--global_batch_size=6 \(mlp\) does not "
                       r"split into the 4 devices of mgloop:ring@2x2; use a multiple of 4$"):
        bench_plan.check_batch(plan, 6, "mlp")
