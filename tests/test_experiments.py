"""The experiment flagfiles make valid Configs; experiments/variants.py measures variants side by
side and writes its table, JSON and HParams; the benchmark kit's shared timing
(experiments/benchlib.py) rotates, takes medians and ratios, and reads its children; every
entry and command is in experiments/README.md."""

import glob
import json
import os
import subprocess
import sys

from absl import flags
import pytest

from mgloop.runs import flags as mgloop_flags
from mgloop.aggregation import exchange_options
from tests import dataset_files, tensorboard_server

from mgloop.runs.sweep import grid as variants_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FLAGFILES = sorted(glob.glob(os.path.join(ROOT, "experiments", "*.flags")))


def config_of(flagfile, *overrides):
    mgloop_flags.define_flags()
    try:
        flags.FLAGS(["train", f"--flagfile={flagfile}", *overrides])
        return mgloop_flags.config_from_flags()
    finally:
        flags.FLAGS.unparse_flags()


def test_the_experiments_have_flagfiles():
    names = {os.path.basename(path) for path in FLAGFILES}
    assert {"minigooglenet_cifar10.flags", "big_mlp.flags"} <= names


@pytest.mark.parametrize("flagfile", FLAGFILES, ids=os.path.basename)
def test_flagfile_makes_a_valid_config(flagfile, tmp_path):
    cifar = tmp_path / "cifar"
    dataset_files.write_cifar10(str(cifar))
    config = config_of(flagfile, f"--logdir={tmp_path / 'run'}")
    overrides = {"data_dir": str(cifar)} if config.dataset == "cifar10" else {}
    validated = config.__class__(**{**config.__dict__, **overrides}).validated()
    assert validated.global_batch_size % validated.num_towers == 0
    if config.model == "minigooglenet":  # the tutorial's recipe
        assert (config.dataset, config.lr_schedule, config.learning_rate, config.momentum,
                config.global_batch_size) == ("cifar10", "poly", 5e-3, 0.9, 256)
        assert config.train_steps == -(-70 * 50000 // 256)  # 70 epochs of 50,000 images


def test_cifar_flagfile_without_real_files_names_data_dir(tmp_path):
    config = config_of(os.path.join(ROOT, "experiments", "minigooglenet_cifar10.flags"),
                       f"--logdir={tmp_path / 'run'}", f"--data_dir={tmp_path / 'missing'}")
    with pytest.raises(Exception, match=r"^--data_dir=.*missing is not a directory"):
        config.validated()


def run_variants(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments.variants", *args],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))


def test_variants_write_a_table_json_and_one_hparams_session_each(tmp_path):
    """Two variants, one of them a plugin's method: one timed step each, read back from the
    table, the JSON and TensorBoard's HParams data (real event files, a real server)."""
    out = tmp_path / "variants"
    result = run_variants("--plugin=tests.plugins.bench_plugin",  # registers ps_cpu_copy
                          "--vary=aggregation=ps_cpu_copy,ring", "--set=devices=cpu:2",
                          "--set=global_batch_size=16", "--steps=1", "--warmup=0",
                          "--repeats=1", "--measure=traffic,input_wait", "--link=1gbit,50us",
                          f"--output_dir={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    payload = json.loads((out / "variants.json").read_text())
    rows = {row["variant"]: row for row in payload["rows"]}
    assert list(rows) == ["aggregation=ps_cpu_copy", "aggregation=ring"]
    for row in rows.values():
        (repeats,) = row["step_ms_repeats"]  # one build, one timed loop
        assert len(repeats) == 1 and row["examples_per_sec"] > 0
        assert abs(row["examples_per_sec"] - 16 / (repeats[0] / 1e3)) < 1e-6 * row[
            "examples_per_sec"]
        assert row["max_sent_kib"] > 0 and row["input_wait_ms"] >= 0
    ring, ps_cpu = rows["aggregation=ring"], rows["aggregation=ps_cpu_copy"]
    assert ps_cpu["ratio"] == 1.0
    assert abs(ring["ratio"] - ring["step_ms"] / ps_cpu["step_ms"]) < 1e-12
    # the one timed step of each is its first, from the seed's weights on the same batch:
    # the same forward ops on the same numbers, so the same loss
    assert ring["loss"] == pytest.approx(ps_cpu["loss"], rel=1e-6)
    # a ring of T devices sends 2(T-1)/T of the gradients' bytes per device: all of them at
    # T = 2, as each tower sends its gradients to the parameter server
    assert ring["max_sent_kib"] == ps_cpu["max_sent_kib"]
    for row in rows.values():  # --link: the model of the counted traffic (link_model.py)
        expected = max(5e-5 * max(row["messages"][d].values())
                       + max(row["traffic"][d].values()) / 1.25e8 for d in row["traffic"])
        assert row["link_1gbit_50us_exchange_ms"] == pytest.approx(1e3 * expected, rel=1e-9)
        assert row["compute_ms"] == pytest.approx(max(row["step_ms"] - row["exchange_ms"], 0))
        assert row["link_1gbit_50us_step_ms"] == pytest.approx(
            row["compute_ms"] + row["link_1gbit_50us_exchange_ms"])
    assert ring["compression_ratio"] == pytest.approx(
        ps_cpu["bytes_per_device_kib"] / ring["bytes_per_device_kib"])
    table = (out / "variants.md").read_text().splitlines()
    header = next(line for line in table if line.startswith("| variant"))
    body = [line for line in table if line.startswith("| aggregation=")]
    assert len(body) == 2 and all(line.count("|") == header.count("|") for line in body)
    assert "max sent/device/step (KiB)" in header
    assert "modelled exchange at 1gbit,50us (ms)" in header
    request = {"experimentName": "", "startIndex": 0, "sliceSize": 10,
               "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS"],
               "colParams": [{"hparam": "aggregation"}, {"hparam": "pack_bytes"},
                             {"hparam": "plugins"}, {"metric": {"tag": "examples_per_sec"}},
                             {"metric": {"tag": "link_1gbit_50us_exchange_ms"}}]}
    with tensorboard_server.serve(str(out / "tensorboard")) as board:
        sessions = board.wait_for(lambda s: len(s.get("sessionGroups", [])) == 2,
                                  "/data/plugin/hparams/session_groups", body=request)
    for group in sessions["sessionGroups"]:
        row = rows[f"aggregation={group['hparams']['aggregation']}"]
        # what a training run records (every setting that can change a result)
        assert group["hparams"]["pack_bytes"] == exchange_options.DEFAULT_BUCKET_BYTES
        assert group["hparams"]["plugins"] == "tests.plugins.bench_plugin"
        values = {m["name"]["tag"]: m["value"] for m in group["metricValues"]}
        assert abs(values["examples_per_sec"] - row["examples_per_sec"]) < 1e-3 * values[
            "examples_per_sec"]
        assert values["link_1gbit_50us_exchange_ms"] == pytest.approx(
            row["link_1gbit_50us_exchange_ms"], rel=1e-6)


@pytest.mark.parametrize("args,error", [
    (["--vary=global_batch_size=16,x"], "--vary global_batch_size: 'x' is not an int"),
    (["--vary=diagnostics=maybe"], "--vary diagnostics: 'maybe' is not a bool (true or false)"),
    (["--set=learning_rate=fast"], "--set learning_rate: 'fast' is not a float"),
])
def test_variants_type_errors_are_one_line(tmp_path, args, error):
    with pytest.raises(variants_spec.SpecError) as raised:
        variants_spec.variants([a.split("=", 1)[1] for a in args if a.startswith("--vary")],
                               [a.split("=", 1)[1] for a in args if a.startswith("--set")])
    assert str(raised.value) == error


# Issue 15's rows (aggregation/transport_dtype), in the issue's order: dense ring, fp16
# transport, top-k 1% with and without error feedback, random-k 1%, DGC 0.1%, QSGD,
# TernGrad, signSGD, EF-signSGD, onebit, PowerSGD rank 1, 2 and 4.
COMPRESSION_ROWS = [  # aggregation/transport_dtype/optimizer (DGC: its own momentum)
    f"{row}/{'sgd' if row.startswith('dgc') else 'momentum'}" for row in [
        "ring/float32", "ring/float16", "topk:ratio=0.01/float32",
        "topk:ratio=0.01,memory=none/float32", "randomk:ratio=0.01/float32",
        "dgc:ratio=0.001/float32", "qsgd/float32", "terngrad/float32", "signsgd/float32",
        "efsignsgd/float32", "onebit/float32", "powersgd:rank=1/float32",
        "powersgd:rank=2/float32", "powersgd:rank=4/float32"]]


def test_compression_ablation_flagfile_has_the_issue_rows_on_one_setting(monkeypatch):
    """The flagfile of issue 15's table (read as absl reads it, nested flagfile included)
    gives its rows on resnet20/synthetic_cifar, 4 towers, one seed, three links."""
    monkeypatch.chdir(ROOT)
    items = flags.FlagValues().read_flags_from_files(
        ["--flagfile=experiments/variants_flags/compression_ablation.flags"], force_gnu=True)
    values = lambda name: [i.split("=", 1)[1] for i in items if i.startswith(f"--{name}=")]
    variants = variants_spec.variants(values("vary"), values("set"))
    assert [v.name.split("=", 1)[1] for v in variants] == COMPRESSION_ROWS
    for variant in variants:
        assert {key: variant.settings[key] for key in ("model", "dataset", "devices", "seed")} \
            == {"model": "resnet20", "dataset": "synthetic_cifar", "devices": "cpu:4", "seed": 0}
    assert values("link") == ["1gbit,50us", "10gbit,10us", "100gbit,2us"]
    assert values("measure") == ["eval"] and "--skip_invalid" in items


def test_variants_refuse_a_bad_value_before_building(tmp_path):
    out = tmp_path / "variants"
    result = run_variants("--vary=global_batch_size=16,x", f"--output_dir={out}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "variants.py: error: --vary global_batch_size: 'x' is not an int")
    assert not out.exists()


def test_variant_values_split_and_tie():
    assert variants_spec.split_values("aggregation", "ring:shards=2,chunks=4,ps_cpu") == [
        "ring:shards=2,chunks=4", "ps_cpu"]
    assert variants_spec.split_values("devices", "gpu:0,1;gpu:0") == ["gpu:0,1", "gpu:0"]
    made = variants_spec.variants(["devices/aggregation=cpu:1/ring,cpu:4/ps_cpu",
                                   "pack_bytes=0,65536"], ["global_batch_size=32"])
    assert [v.name for v in made][:2] == ["devices/aggregation=cpu:1/ring,pack_bytes=0",
                                          "devices/aggregation=cpu:1/ring,pack_bytes=65536"]
    assert made[3].settings == {"devices": "cpu:4", "aggregation": "ps_cpu",
                                "pack_bytes": 65536, "global_batch_size": 32}


def test_overlap_of_a_synthetic_trace():
    """`experiments/traces.py overlap`'s figures on a trace made by hand: backward ops (the
    gradient tape's, in the compute phase) at 10..30 and 40..60 ps, exchange ops at 25..45
    and 70..90."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    from experiments import traces
    space = xplane_pb2.XSpace()
    host = space.planes.add(name="/host:CPU")
    one, two = host.lines.add(timestamp_ns=0), host.lines.add(timestamp_ns=0)
    for line, name, start, end in [
            (one, "while/body/mgloop_step/compute/dense/MatMul:MatMul", 0, 10),  # forward
            (one, "while/body/gradient_tape/mgloop_step/compute_1/dense/MatMul:MatMul", 10, 30),
            (one, "while/body/gradient_tape/mgloop_step/compute_1/dense_1/Add:AddV2", 40, 60),
            (two, "while/body/mgloop_step/aggregation/split:SplitV", 25, 45),
            (two, "while/body/mgloop_step/aggregation/add:AddV2", 70, 90),
            (two, "while/body/mgloop_step/apply/sgd/Sub:Sub", 90, 95)]:
        metadata_id = len(host.event_metadata) + 1
        host.event_metadata[metadata_id].id = metadata_id
        host.event_metadata[metadata_id].name = name
        line.events.add(metadata_id=metadata_id, offset_ps=start, duration_ps=end - start)
    figures = traces.overlap_of(space)
    assert figures["exchange_ms"] == pytest.approx(40e-9)  # 20 + 20 ps
    assert figures["backward_ms"] == pytest.approx(40e-9)  # the forward op is not backward
    assert figures["overlap"] == pytest.approx(10 / 40)  # 25..30 and 40..45 at once
    assert figures["early"] == pytest.approx(20 / 40)  # 25..45 before the backward ends (60)
    assert figures["starts"] == pytest.approx((25 - 10) / (60 - 10))


# --- the benchmark kit: shared timing (experiments/benchlib.py), entries, README ---

EXPERIMENTS = os.path.join(ROOT, "experiments")


def test_rounds_rotate_the_order_and_ratios_are_to_the_baseline():
    from experiments import benchlib
    calls = []
    values = {"a": iter([9, 1, 2, 3]), "b": iter([9, 4, 5, 6]), "c": iter([9, 7, 8, 10])}
    runs = {name: (lambda name=name: calls.append(name) or next(values[name]))
            for name in values}
    samples = benchlib.rounds(runs, 3, warmup=1)
    # warm-up case by case (its values dropped), then each round starts one case later
    assert calls == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert samples == {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8, 10]}
    rows = benchlib.summarize(samples)
    assert [(r["case"], r["median"], r["mad"], r["rounds"]) for r in rows] == [
        ("a", 2.0, 1.0, [1, 2, 3]), ("b", 5.0, 1.0, [4, 5, 6]), ("c", 8.0, 1.0, [7, 8, 10])]
    benchlib.add_ratio(rows, "median", "b")
    benchlib.add_ratio(rows, "median", "b", out="speedup", inverse=True)
    assert [r["ratio"] for r in rows] == [2 / 5, 1.0, 8 / 5]
    assert [r["speedup"] for r in rows] == [5 / 2, 1.0, 5 / 8]
    # a child's figures (dicts): the median of each number, the rest as the first round's
    rows = benchlib.summarize({"x": [{"ms": 3.0, "towers": 4, "kind": "k"},
                                     {"ms": 1.0, "towers": 4, "kind": "k"},
                                     {"ms": 2.0, "towers": 4, "kind": "k"}]})
    assert (rows[0]["ms"], rows[0]["towers"], rows[0]["kind"]) == (2.0, 4.0, "k")


def test_a_child_replies_once_and_a_failing_child_says_why():
    from experiments import benchlib
    code = ("from experiments import benchlib; print('noise'); "
            "benchlib.child_reply({'ms': 1.5}); print('more noise')")
    assert benchlib.run_child([sys.executable, "-c", code]) == {"ms": 1.5}
    samples = benchlib.in_children({"one": [sys.executable, "-c", code]}, 2)
    assert samples == {"one": [{"ms": 1.5}, {"ms": 1.5}]}
    with pytest.raises(benchlib.ChildError, match=r"exit code 3, 0 results:\n.*broken"):
        benchlib.run_child([sys.executable, "-c",
                            "import sys; sys.stderr.write('broken'); sys.exit(3)"])


def entries() -> dict[str, list[str]]:
    """Each runnable script of experiments/ (but bench.py's worker) -> its COMMANDS, if any."""
    import ast
    out = {}
    for path in sorted(glob.glob(os.path.join(EXPERIMENTS, "*.py"))):
        source = open(path).read()
        if 'if __name__ == "__main__":' not in source or path.endswith("bench_worker.py"):
            continue
        commands = []
        for node in ast.parse(source).body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", None)
                                                 for t in node.targets] == ["COMMANDS"]:
                commands = [key.value for key in node.value.keys]
        out[os.path.basename(path)] = commands
    return out


def test_the_readme_lists_every_entry_and_command():
    readme = open(os.path.join(EXPERIMENTS, "README.md")).read()
    found = entries()
    assert {"bench.py", "variants.py", "soak.py", "towers.py", "input.py", "memory.py",
            "methods_between_nodes.py", "traces.py", "startup.py"} <= set(found)
    for script, commands in found.items():
        module = "experiments." + script[:-len(".py")]
        assert f"python -m {module}" in readme, script
        for command in commands:
            assert f"`{script} {command}`" in readme, (script, command)
            assert f"python -m {module} {command}" in readme, (script, command)


def test_an_entry_times_fresh_processes_and_writes_its_json(tmp_path):
    out = tmp_path / "startup.json"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.startup", "--cases=python,mgloop",
         "--baseline=python", "--rounds=2", f"--json_out={out}"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["command"].startswith("python -m experiments.startup --cases=python,mgloop")
    assert payload["settings"] == {"cases": ["python", "mgloop"], "baseline": "python",
                                   "rounds": 2}
    assert payload["machine"]["cpus"] >= 1
    python, mgloop = payload["rows"]
    assert (python["case"], mgloop["case"]) == ("python", "mgloop")
    for row in (python, mgloop):
        assert len(row["rounds"]) == 2 and row["median"] > 0
    assert python["ratio"] == 1.0 and python["difference_s"] == 0.0
    assert mgloop["ratio"] == pytest.approx(mgloop["median"] / python["median"])
    assert "| mgloop | import mgloop |" in result.stdout
    bad = subprocess.run([sys.executable, "-m", "experiments.towers", "nothing"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode != 0
    assert "'nothing' is not a command; give one of: many, kernels, matmuls" in bad.stderr


def test_the_scale_trend_is_the_percent_gap_in_loss_with_its_standard_error(tmp_path,
                                                                            monkeypatch):
    """experiments/scale_trend.py on hand-made records: gap = 100 (L_m - L_ring) / L_ring of
    the seeds' mean losses, its error sqrt(s_m^2/n + s_r^2/n) / L_ring * 100; a size with no
    ring has no row, a diverged seed (no loss) makes the gap NaN rather than vanishing."""
    from experiments import scale_trend

    def write(study, variant, losses):
        folder = tmp_path / study / "results" / f"{variant}-abc123"
        folder.mkdir(parents=True)
        for seed, loss in enumerate(losses):
            (folder / f"seed={seed}.json").write_text(json.dumps({"eval": {"loss": loss}}))

    write("small", "aggregation=ring", [2.0, 2.2])
    write("small", "aggregation=diloco", [2.2, 2.6])
    write("small", "aggregation=bad", [2.0, None])
    write("large", "aggregation=diloco", [1.0])  # no ring at this size: no row
    # an include is followed where it stands (found in the studies' folder by its name)
    (tmp_path / "small.flags").write_text("--flagfile=experiments/studies/base.flags\n"
                                          "--set=lm_layers=1\n--set=lm_width=8\n--set=seed=4\n")
    (tmp_path / "base.flags").write_text("--set=lm_width=4\n--set=lm_heads=2\n")
    (tmp_path / "large.flags").write_text("--set=lm_heads=2\n")
    monkeypatch.setattr(scale_trend, "SIZES", {
        "small": {"ring": ("small", "aggregation=ring"), "d": ("small", "aggregation=diloco"),
                  "x": ("small", "aggregation=bad")},
        "large": {"ring": ("large", "aggregation=ring"), "d": ("large", "aggregation=diloco")}})
    sizes = []
    monkeypatch.setattr(scale_trend, "parameters",
                        lambda settings: sizes.append(settings) or 1000 * settings["lm_layers"])
    rows = {row["method"]: row for row in scale_trend.rows(str(tmp_path))}
    assert set(rows) == {"ring", "d", "x"} and rows["d"]["parameters"] == 1000
    # the flagfile's, its include's where it sets no other (the later line wins), once a size
    assert sizes == [{"lm_layers": 1, "lm_width": 8, "lm_heads": 2}]
    assert rows["d"]["gap"] == pytest.approx(100 * (2.4 - 2.1) / 2.1)
    assert rows["d"]["gap_se"] == pytest.approx(100 * (0.08 / 2 + 0.02 / 2) ** 0.5 / 2.1)
    assert rows["x"]["gap"] != rows["x"]["gap"]  # NaN
    assert "| 1,000 | ring | 2 |" in scale_trend.table(list(rows.values()))
    axis = scale_trend.plot(list(rows.values()), str(tmp_path / "trend.png"))
    labels = [text.get_text() for text in axis.get_legend().get_texts()]
    assert "x: a seed diverged" in labels and "d" in labels  # marked, not dropped
