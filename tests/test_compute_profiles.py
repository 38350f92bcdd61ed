"""`--compute` and `--node_speeds` (observe/hardware.py, observe/flops.py, runs/step_flops.py):
the FLOPs counted from the traced training step against counts made by hand from the layer
shapes and against the standard 6N + 12 L T W per token; the formula C = F b / (P E) / min s;
refusals before anything is built; a run trains the same with a profile and reports the
modelled compute (summary.json, TensorBoard text, a sweep's record and report)."""

import glob
import math
import os
import types

import numpy as np
import pytest
import tensorflow as tf

import mgloop
from mgloop.aggregation.traffic import Traffic
from mgloop.errors import ConfigError
from mgloop.models import transformer_lm
from mgloop.observe import hardware, link_model, link_report, link_scalars
from mgloop.runs import callbacks, step_flops
from mgloop.runs.sweep import grid, record, report
from mgloop.runs.sweep import plan as plan_lib
from mgloop.training import losses
from tests import helpers

INT, FLOAT = tf.int32, tf.float32


def _count(model, features, labels, batch=4):
    return step_flops.flops_per_example(model, losses.cross_entropy, features, labels, batch)


def test_transformer_lm_flops_are_its_products_and_within_10_percent_of_6n_plus_attention():
    """Per token, the forward's products are 2(12 L W^2 + W V) (q, k, v, output: 4 W^2; the
    MLP 8 W^2; the logits W V) and the attention 4 L T W (scores QK^T and weights times V,
    each T W per token and layer); the backward is twice the forward (every product's two
    inputs need their gradients: block 0's from the embeddings). The standard count is
    6N + 12 L T W per token (Kaplan et al. 2020, arXiv 2001.08361, C = 6N with N the
    non-embedding parameters; the attention term as in Chowdhery et al. 2022, arXiv
    2204.02311, appendix B, scores and weighted sum both counted), N here every parameter
    but the token and position embeddings: the untied output projection (logits) with its
    bias, the biases and the layer norms included. The count leaves out the element-wise
    work of biases and norms, so it is just below."""
    layers, width, heads, length, vocab = 2, 32, 4, 16, 256
    model = transformer_lm.transformer_lm((length,), vocab, lm_layers=layers, lm_width=width,
                                          lm_heads=heads)
    count = _count(model, tf.TensorSpec([length], FLOAT), tf.TensorSpec([length], INT))
    assert count.uncounted == []
    products = 12 * layers * width ** 2 + width * vocab
    attention = 12 * layers * length * width
    assert count.flops == length * (6 * products + attention)
    assert count.by_type["Einsum"] == 4 * length * attention  # 4 examples traced
    n = model.count_params() - (vocab + length) * width
    standard = length * (6 * n + 12 * layers * length * width)
    assert abs(count.flops - standard) <= 0.1 * standard
    assert count.flops < standard


def test_mlp_and_cnn_flops_are_counted_from_their_layers_shapes():
    """2 FLOPs per multiply-add; forward, the kernels' gradients, and the inputs' gradients
    but the first layer's (no output needs it: TensorFlow never computes it)."""
    mlp = helpers.model_fn("mlp")()
    kernels = [layer.kernel.shape for layer in mlp.layers if hasattr(layer, "kernel")]
    macs = [k[0] * k[1] for k in kernels]
    count = _count(mlp, tf.TensorSpec(helpers.DATASET.input_shape, FLOAT), tf.TensorSpec([], INT))
    assert count.flops == 2 * sum(macs) * 3 - 2 * macs[0] == 105984
    cnn = helpers.model_fn("cnn")()
    macs = []
    for layer in cnn.layers:
        if hasattr(layer, "kernel"):
            out = layer.output.shape[1:]
            macs.append(math.prod(out[:-1]) * math.prod(layer.kernel.shape))
    count = _count(cnn, tf.TensorSpec(helpers.DATASET.input_shape, FLOAT), tf.TensorSpec([], INT))
    assert count.uncounted == [] and count.by_type["Conv2D"] > 0
    assert count.flops == 2 * sum(macs) * 3 - 2 * macs[0]


def test_the_modelled_compute_is_flops_times_examples_over_peak_times_efficiency():
    setting = hardware.parse("V100:efficiency=0.25")
    assert (setting.profile, setting.efficiency, setting.peak) == ("v100", 0.25, 125e12)
    assert hardware.parse("a100") == hardware.ComputeSetting("profile", "a100", 0.4)
    compute = hardware.modelled(setting, 0.3, 1e9, 8, (1.0, 0.5, 2.0))
    assert compute.seconds == pytest.approx(1e9 * 8 / (125e12 * 0.25) / 0.5, rel=1e-15)
    assert compute.source == ("profile v100 at 0.25 of 125e12 FLOP/s, 1e+09 FLOPs per example, "
                              "8 examples per tower step; waits for the slowest node (speed 0.5)")
    assert compute.measured_seconds == 0.3
    measured = hardware.modelled(hardware.parse("measured"), 0.3, speeds=(1.0, 0.25))
    assert measured.seconds == pytest.approx(1.2) and measured.source.startswith("measured")
    given = hardware.modelled(hardware.parse("seconds=0.05"), 0.3)
    assert (given.seconds, given.source) == (0.05, "given")
    assert hardware.modelled(setting, 0.3, None, 8).seconds is None  # FLOPs not counted
    assert hardware.modelled(hardware.parse("measured"), None).seconds is None
    h100 = hardware.modelled(hardware.parse("h100:efficiency=1"), None, 989e12, 1)
    assert h100.seconds == pytest.approx(1.0)


@pytest.mark.parametrize("overrides, message", [
    (dict(compute="b200"), "--compute=b200: 'b200' is not measured, seconds=X nor a profile"),
    (dict(compute="a100:efficiency=0"), "efficiency=0 is out of range"),
    (dict(compute="a100:efficiency=1.5"), "efficiency=1.5 is out of range"),
    (dict(compute="a100:efficiency=nan"), "is not a finite number"),
    (dict(compute="a100:eff=0.3"), "the profile's one option is efficiency=E"),
    (dict(compute="seconds=0"), "give seconds=X with X > 0"),
    (dict(compute="seconds=fast"), "seconds 'fast' is not a number"),
    (dict(compute="measured:efficiency=0.4"), "measured takes no options"),
    (dict(node_speeds="1,0.5"), "gives 2 speeds for 1 node:"),
    (dict(devices="cpu:2", nodes=2, aggregation="ring", node_speeds="1,0"),
     "every speed must be > 0"),
    (dict(devices="cpu:2", nodes=2, aggregation="ring", node_speeds="1,x"),
     "speed 'x' is not a number (e.g. --node_speeds=1,1,0.5,1: node 2 at half speed"),
    (dict(node_speeds=""), "--node_speeds is set but empty; give one speed factor per node "
                           "(e.g. --node_speeds=1,1,0.5,1: node 2 at half speed"),
    (dict(devices="cpu:2", nodes=2, aggregation="ring", node_speeds="1,"),
     "speed '' is not a number (e.g. --node_speeds=1,1,0.5,1"),
])
def test_bad_settings_are_refused_in_one_line_before_anything_is_built(logdir, overrides,
                                                                      message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as refused:
        helpers.small_config(logdir, **overrides).validated(on_disk=False)
    assert "\n" not in str(refused.value) and ("--compute" in str(refused.value)
                                               or "--node_speeds" in str(refused.value))
    if "node_speeds" in overrides:  # its own flag named, never --compute's
        assert "--compute" not in str(refused.value)
    assert not os.path.exists(logdir)


def _text_of(logdir, tag):
    for path in glob.glob(os.path.join(logdir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    return tf.make_ndarray(value.tensor).item().decode()
    return None


def test_a_profile_changes_the_modelled_time_and_not_the_training(tmp_path):
    """Two nodes, the second at half speed: the same weights and loss bit for bit with and
    without --compute (the step is traced for its FLOPs, never run); the modelled compute
    is F b / (P E) / 0.5 with F the mlp's count (above) and b the 8 examples per tower,
    and every modelled step time uses it. The profiled run does not time its exchange apart
    (--time_exchange=false): no exchange_seconds, its measured compute the whole step."""
    base = dict(devices="cpu:2", nodes=2, aggregation="ring", train_steps=4, steps_per_loop=2,
                links=("10gbit,10us",))
    plain = mgloop.run(helpers.small_config(str(tmp_path / "plain"), time_exchange=True,
                                            **base))
    profiled = mgloop.run(helpers.small_config(
        str(tmp_path / "a100"), compute="a100:efficiency=0.5", node_speeds="1,0.5",
        time_exchange=False, **base))
    for a, b in zip(plain.trainer.model.get_weights(), profiled.trainer.model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert plain["final_train_loss"] == profiled["final_train_loss"]
    assert plain["eval_loss"] == profiled["eval_loss"]
    measured, modelled = plain["link_model"], profiled["link_model"]
    assert measured["compute_source"] == "measured"
    assert measured["compute_seconds"] == pytest.approx(
        max(plain["median_step_time"] - plain["exchange_seconds"], 0.0), rel=1e-12)
    expected = 105984 * 8 / (312e12 * 0.5) / 0.5
    assert modelled["compute_seconds"] == pytest.approx(expected, rel=1e-12)
    assert modelled["flops_per_example"] == 105984 and modelled["node_speeds"] == [1.0, 0.5]
    assert modelled["compute_source"] == (
        "profile a100 at 0.5 of 312e12 FLOP/s, 105984 FLOPs per example, 8 examples per "
        "tower step; waits for the slowest node (speed 0.5)")
    assert plain["exchange_seconds"] > 0 and profiled["exchange_seconds"] is None
    assert modelled["measured_compute_seconds"] == pytest.approx(
        profiled["median_step_time"], rel=1e-12) and modelled["measured_compute_seconds"] > 0
    figures = modelled["links"]["10gbit_10us"]
    assert figures["exchange_seconds"] == measured["links"]["10gbit_10us"]["exchange_seconds"]
    assert figures["step_seconds_no_overlap"] == pytest.approx(
        expected + figures["exchange_seconds"], rel=1e-12)
    assert figures["step_seconds_overlap"] == pytest.approx(
        max(expected, figures["exchange_seconds"]), rel=1e-12)
    assert _text_of(str(tmp_path / "a100"), "link/compute_source") == modelled["compute_source"]
    assert _text_of(str(tmp_path / "plain"), "link/compute_source") == "measured"
    scalars = link_scalars.scalars(modelled)
    assert scalars["link/compute_seconds"] == modelled["compute_seconds"]
    assert scalars["link/flops_per_example"] == 105984


def test_a_sweep_record_and_report_use_the_modelled_compute_and_say_which(tmp_path):
    """The record's modelled seconds are s C + the exchange, C the summary's modelled one;
    the report says which compute each variant's seconds use."""
    traffic = Traffic(node_of={"CPU:0": 0, "CPU:1": 1})
    traffic.record("CPU:0", "CPU:1", 1000)  # every step
    links = ["10gbit,10us"]
    compute = hardware.modelled(hardware.parse("t4"), 0.2, 1e6, 4)
    summary = {"final_step": 8, "stopped_by": None, "eval_metrics": {"loss": 1.0},
               "config": {"links": links},
               "link_model": link_report.report(
                   link_report.Schedule(traffic, 8), [link_model.parse(t) for t in links],
                   compute.seconds, gradient_bytes=4000, num_nodes=2, compute_of=compute)}
    result = types.SimpleNamespace(
        summary=summary, history=callbacks.History(),
        trainer=types.SimpleNamespace(aggregation=types.SimpleNamespace(traffic=traffic)))
    result.history(4, {"eval/loss": 2.0})
    cell = plan_lib.Cell(grid.Variant("aggregation=ring", {}, {}, (("aggregation", "ring"),)), 0)
    rec = record.record_of(cell, result, None)
    c = 1e6 * 4 / (65e12 * 0.4)
    exchange = link_model.exchange_seconds(traffic.at_step(0), link_model.parse(links[0]))
    assert rec["compute_seconds"] == pytest.approx(c, rel=1e-15)
    assert rec["compute_source"] == compute.source and compute.source.startswith("profile t4")
    assert rec["curve"][0]["seconds"]["10gbit_10us"] == pytest.approx(4 * (c + exchange))
    record.write(str(tmp_path / "results" / "ring" / "seed=0.json"), rec)
    text = open(report.write(str(tmp_path), None, "compute")).read()
    assert f"Compute per step in the modelled seconds: {compute.source}." in text


def test_a_transformer_lm_run_counts_the_flops_of_its_own_settings(logdir, tmp_path):
    """--dataset=text --model=transformer_lm with a profile: the summary's F is the
    count above for the run's resolved lm_layers, lm_width, sequence_length and the byte
    vocabulary (256), and C = F b / (P E) with b the per-tower batch times the
    accumulation steps."""
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    summary = mgloop.run(helpers.small_config(
        logdir, dataset="text", data_dir=str(tmp_path / "text"), model="transformer_lm",
        lm_layers=1, lm_width=16, lm_heads=2, sequence_length=8, global_batch_size=4, devices="cpu:2", train_steps=2,
        steps_per_loop=2, accumulation_steps=2, compute="t4:efficiency=0.3"))
    config = summary["config"]
    layers, width, length = config["lm_layers"], config["lm_width"], config["sequence_length"]
    per_token = 6 * (12 * layers * width ** 2 + width * 256) + 12 * layers * length * width
    report = summary["link_model"]
    assert report["flops_per_example"] == length * per_token
    assert report["compute_seconds"] == pytest.approx(
        length * per_token * (2 * 2) / (65e12 * 0.3), rel=1e-12)
    assert report["compute_source"].startswith("profile t4 at 0.3 of 65e12 FLOP/s")
