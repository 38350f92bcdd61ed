"""experiments/bench.py end to end in a tiny configuration: two systems, two steps."""

import json
import os
import subprocess
import sys

import numpy as np

from tests import tensorboard_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_harness_runs_and_its_outputs_parse(tmp_path):
    out = tmp_path / "bench"
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "experiments", "bench.py"), "--models=mlp",
         "--towers=2", "--modes=ps_cpu,mirrored_ctl", "--steps=2", "--warmup=1", "--repeats=2",
         f"--output_dir={out}"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert result.returncode == 0, result.stderr[-3000:]
    payload = json.loads((out / "bench.json").read_text())
    assert payload["settings"]["steps"] == 2 and payload["machine"]["cpus"] >= 1
    (model,) = payload["results"]
    rows = {row["name"]: row for row in model["rows"]}
    assert set(rows) == {"mgloop:ps_cpu@2", "mirrored_ctl@2"}
    for row in rows.values():
        assert len(row["step_ms_repeats"]) == 2 and row["examples_per_sec"] > 0
        per_repeat = [model["global_batch"] / (ms / 1e3) for ms in row["step_ms_repeats"]]
        assert abs(row["examples_per_sec"] - float(np.median(per_repeat))) < 1e-6
        assert row["peak_rss_mib"] >= row["baseline_rss_mib"] > 50  # TensorFlow is resident
    assert rows["mirrored_ctl@2"]["step_ratio_to_mirrored"] == 1.0
    ratio = rows["mgloop:ps_cpu@2"]["step_ms"] / rows["mirrored_ctl@2"]["step_ms"]
    assert abs(rows["mgloop:ps_cpu@2"]["step_ratio_to_mirrored"] - ratio) < 1e-12
    table = (out / "bench.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| system"))
    body = [line for line in table.splitlines() if line.startswith("| mgloop:ps_cpu@2")]
    assert len(body) == 1 and body[0].count("|") == header.count("|")
    with tensorboard_server.serve(str(out / "tensorboard")) as board:
        tags = board.wait_for(lambda t: len(t) == 2, "/data/plugin/scalars/tags")
        assert set(tags) == {"mlp/mgloop_ps_cpu_2", "mlp/mirrored_ctl_2"}
        (_, _, eps), = board.scalars("mlp/mirrored_ctl_2", "examples_per_sec")
        assert abs(eps - rows["mirrored_ctl@2"]["examples_per_sec"]) < 1e-3 * eps
        request = {"experimentName": "", "startIndex": 0, "sliceSize": 10,
                   "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS"],
                   "colParams": [{"hparam": "system"}, {"hparam": "towers"},
                                 {"metric": {"tag": "examples_per_sec"}}]}
        sessions = board.wait_for(lambda s: len(s.get("sessionGroups", [])) == 2,
                                  "/data/plugin/hparams/session_groups", body=request)
        systems = {group["hparams"]["system"] for group in sessions["sessionGroups"]}
        assert systems == {"mgloop:ps_cpu", "mirrored_ctl"}
