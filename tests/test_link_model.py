"""The link model (mgloop/observe/link_model.py) against hand-computed alpha-beta times, the counted
messages of the real methods, --link parsing, and its figures in summary.json and TensorBoard."""

import json
import logging

import pytest
import tensorflow as tf

import mgloop
from mgloop import aggregation
from mgloop.observe import link_model
from mgloop.aggregation.base import Traffic
from mgloop.cluster.devices import DeviceSet
from tests import helpers, tensorboard_server

TEN_GBIT = link_model.parse("10gbit,10us")  # B = 1.25e9 bytes/s, a = 1e-5 s
ONE_GBIT = link_model.parse("1gbit,50us")  # B = 1.25e8 bytes/s, a = 5e-5 s
S = 8_000_000  # gradient bytes of the synthetic step: S / B = 6.4e-3 s at 10 Gbit/s


def devices(towers):
    return [f"CPU:{t}" for t in range(towers)]


def ring_all_reduce_traffic(towers, num_bytes):
    """The messages of a ring all-reduce of `num_bytes`: 2(T-1) steps, each device sending
    one chunk of num_bytes / T to the next."""
    traffic, names = Traffic(), devices(towers)
    for _ in range(2 * (towers - 1)):
        for t in range(towers):
            traffic.record(names[t], names[(t + 1) % towers], num_bytes // towers)
    return traffic


def ring_all_gather_traffic(towers, num_bytes):
    """An all-gather of num_bytes / T from every device (num_bytes gathered): T-1 steps."""
    traffic, names = Traffic(), devices(towers)
    for _ in range(towers - 1):
        for t in range(towers):
            traffic.record(names[t], names[(t + 1) % towers], num_bytes // towers)
    return traffic


def reduce_broadcast_traffic(towers, num_bytes):
    """Every other device sends num_bytes to device 0, which sends the mean back."""
    traffic, names = Traffic(), devices(towers)
    for t in range(1, towers):
        traffic.record(names[t], names[0], num_bytes)
    for t in range(1, towers):
        traffic.record(names[0], names[t], num_bytes)
    return traffic


def parameter_server_traffic(towers, variable_bytes):
    """ps_cpu with the host on device 0: each tower reads every variable from the host and
    sends its gradient of it back (one message each way per variable)."""
    traffic, names = Traffic(), devices(towers)
    for num_bytes in variable_bytes:
        for t in range(1, towers):
            traffic.record(names[0], names[t], num_bytes)  # parameter read
            traffic.record(names[t], names[0], num_bytes)  # gradient
    return traffic


# Hand-computed at 10 Gbit/s, 10 us, S = 8e6 bytes (S/B = 6.4 ms):
#   ring all-reduce  2(T-1) a + 2(T-1)/T S/B    T=2: 2e-5 + 6.4e-3;  T=4: 6e-5 + 9.6e-3;
#                                               T=8: 1.4e-4 + 11.2e-3
#   ring all-gather  (T-1) a + (T-1)/T S/B      T=2: 1e-5 + 3.2e-3;  T=4: 3e-5 + 4.8e-3;
#                                               T=8: 7e-5 + 5.6e-3
#   reduce_broadcast (T-1) (a + S/B)            T=2: 6.41e-3;  T=4: 19.23e-3;  T=8: 44.87e-3
#   parameter server, 2 variables of S/2:      (T-1) (2 a + S/B)
#                                               T=2: 6.42e-3;  T=4: 19.26e-3;  T=8: 44.94e-3
HAND_COMPUTED = {
    "ring": (ring_all_reduce_traffic, {2: 0.00642, 4: 0.00966, 8: 0.01134}),
    "all_gather": (ring_all_gather_traffic, {2: 0.00321, 4: 0.00483, 8: 0.00567}),
    "reduce_broadcast": (reduce_broadcast_traffic, {2: 0.00641, 4: 0.01923, 8: 0.04487}),
    "parameter_server": (lambda towers, num_bytes: parameter_server_traffic(
        towers, [num_bytes // 2, num_bytes // 2]), {2: 0.00642, 4: 0.01926, 8: 0.04494}),
}


@pytest.mark.parametrize("towers", [2, 4, 8])
@pytest.mark.parametrize("algorithm", sorted(HAND_COMPUTED))
def test_exchange_time_equals_the_hand_computed_alpha_beta_time(algorithm, towers):
    make, expected = HAND_COMPUTED[algorithm]
    modelled = link_model.exchange_seconds(make(towers, S), TEN_GBIT)
    assert modelled == pytest.approx(expected[towers], rel=1e-12)


def test_exchange_time_is_the_busiest_device_and_zero_without_traffic():
    traffic = Traffic()
    traffic.record("CPU:1", "CPU:0", 1000)
    traffic.record("CPU:2", "CPU:0", 1000)  # CPU:0 receives 2 messages, 2000 bytes
    times = link_model.device_seconds(traffic, TEN_GBIT)
    assert times["CPU:0"] == pytest.approx(2e-5 + 2000 / 1.25e9, rel=1e-12)
    assert times["CPU:1"] == pytest.approx(1e-5 + 1000 / 1.25e9, rel=1e-12)
    assert link_model.exchange_seconds(traffic, TEN_GBIT) == times["CPU:0"]
    assert link_model.exchange_seconds(Traffic(), TEN_GBIT) == 0.0


# The real methods' counted traffic, one gradient of n = 1000 float32 (S = 4000 bytes), at
# 1 Gbit/s, 50 us (S/B = 3.2e-5 s), hand-computed:
#   ring, collective  2(T-1) a + 2(T-1)/T S/B   T=2: 1.0e-4 + 3.2e-5;  T=4: 3.0e-4 + 4.8e-5
#   reduce_broadcast  (T-1) (a + S/B)          T=2: 8.2e-5;  T=4: 2.46e-4
#   ps_cpu (the gradients, host on tower 0's CPU: T-1 received there): as reduce_broadcast
REAL = {"ring": {2: 1.32e-4, 4: 3.48e-4}, "collective": {2: 1.32e-4, 4: 3.48e-4},
        "reduce_broadcast": {2: 8.2e-5, 4: 2.46e-4}, "ps_cpu": {2: 8.2e-5, 4: 2.46e-4}}
MESSAGES = {"ring": lambda t: 2 * (t - 1), "collective": lambda t: 2 * (t - 1),
            "reduce_broadcast": lambda t: t - 1, "ps_cpu": lambda t: t - 1}


@pytest.mark.parametrize("towers", [2, 4])
@pytest.mark.parametrize("method", sorted(REAL))
def test_real_methods_counted_traffic_gives_the_hand_computed_time(method, towers):
    names = tuple(f"/device:CPU:{t}" for t in range(towers))
    reducer = aggregation.make(method, DeviceSet(towers=names))
    values = []
    for t, device in enumerate(names):
        with tf.device(device):
            values.append([tf.fill([1000], float(t))])
    with reducer.step():  # counted while traced, as in the training step
        tf.function(lambda: reducer.reduce(values, variables=[None])).get_concrete_function()
    traffic = reducer.traffic
    busiest = max(max(traffic.messages_sent.get(d, 0), traffic.messages_received.get(d, 0))
                  for d in traffic.devices())
    assert busiest == MESSAGES[method](towers)
    assert link_model.exchange_seconds(traffic, ONE_GBIT) == pytest.approx(
        REAL[method][towers], rel=1e-12)


@pytest.mark.parametrize("text,message", [
    ("10gbit", r"^--link=10gbit: give BANDWIDTH,LATENCY \(e\.g\. --link=10gbit,10us\)$"),
    ("10gb,1us", r"^--link=10gb,1us: bandwidth '10gb' is not a number with a unit of bit, "),
    ("0gbit,1us", r"^--link=0gbit,1us: the bandwidth must be > 0$"),
    ("1gbit,-5us", r"^--link=1gbit,-5us: latency '-5us' is not a number with a unit of ns, "),
    ("1gbit,5", r"^--link=1gbit,5: latency '5' is not a number with a unit of ns, us, ms, s"),
])
def test_bad_links_are_refused_in_one_line(text, message, logdir):
    with pytest.raises(mgloop.ConfigError, match=message):
        helpers.small_config(logdir, links=(text,)).validated()


def test_links_parse_their_units_and_duplicates_are_refused(logdir):
    assert link_model.parse("100Gbit/s, 2us") == link_model.Link("100gbit/s,2us", 12.5e9, 2e-6)
    assert link_model.parse("40gbps,1.5ms").bytes_per_second == 5e9
    assert link_model.parse("40gbps,1.5ms").latency_seconds == pytest.approx(1.5e-3, rel=1e-15)
    with pytest.raises(mgloop.ConfigError, match=r"^--link=1gbit,50us is given twice"):
        helpers.small_config(logdir, links=("1gbit,50us", "1Gbit,50us")).validated()


def test_summary_and_tensorboard_report_the_model_of_the_counted_traffic(logdir):
    """A 2-tower ring run with two links: summary.json's link_model is the model of the
    run's own counted traffic, beside compute = median step - exchange alone; TensorBoard
    has the same figures as train scalars and as HParams metrics of the root run."""
    links = ("1gbit,50us", "100gbit,2us")
    summary = mgloop.run(helpers.small_config(
        logdir, devices="cpu:2", aggregation="ring", train_steps=4, steps_per_loop=4,
        links=links, time_exchange=True))
    # one loop: its first step (the trace) is timed apart, the median from the other three
    assert summary["examples_per_sec"] > 0
    assert 0 < summary["median_step_time"] < summary["traced_step_seconds"] / 3
    with open(f"{logdir}/summary.json") as handle:
        assert json.load(handle)["link_model"] == summary["link_model"]
    report = summary["link_model"]
    bytes_sent = summary["traffic_bytes_per_step"]
    messages = summary["traffic_messages_per_step"]
    assert set(bytes_sent) == set(messages) == {"CPU:0", "CPU:1"}
    compute = max(summary["median_step_time"] - summary["exchange_seconds"], 0.0)
    assert report["compute_seconds"] == pytest.approx(compute, rel=1e-12)
    for text, tag in zip(links, ("1gbit_50us", "100gbit_2us")):
        link = link_model.parse(text)
        expected = max(link.latency_seconds * max(messages[d]["sent"], messages[d]["received"])
                       + max(bytes_sent[d]["sent"], bytes_sent[d]["received"])
                       / link.bytes_per_second for d in bytes_sent)
        figures = report["links"][tag]
        assert figures["exchange_seconds"] == pytest.approx(expected, rel=1e-12) and expected > 0
        assert figures["step_seconds_no_overlap"] == pytest.approx(compute + expected)
        assert figures["step_seconds_overlap"] == pytest.approx(max(compute, expected))
    assert messages["CPU:0"]["sent"] % 2 == 0 and messages["CPU:0"]["sent"] > 0  # 2(T-1) each
    assert report["bytes_per_device"] == max(max(c.values()) for c in bytes_sent.values())
    # a float32 ring of 2 towers: each device moves 2(T-1)/T P = P bytes, all it counted
    # (up to the odd element of a bucket halved), so compression 1
    assert report["compression_ratio"] == pytest.approx(1.0, rel=1e-3)
    with tensorboard_server.serve(logdir) as board:
        tags = board.wait_for(lambda t: "link/1gbit_50us/exchange_seconds" in t.get("train", {})
                              and "final/link/100gbit_2us/exchange_seconds" in t.get(".", {}),
                              "/data/plugin/scalars/tags")
        for tag, figures in report["links"].items():
            for key, value in figures.items():
                if key.endswith("seconds") and key != "latency_seconds":
                    (_, step, train), = board.scalars("train", f"link/{tag}/{key}")
                    (_, _, final), = board.scalars(".", f"final/link/{tag}/{key}")
                    assert step == 4
                    assert train == final == pytest.approx(value, rel=1e-6)
        (_, _, per_device), = board.scalars("train", "link/bytes_per_device")
        assert per_device == report["bytes_per_device"]
        assert "final/compute_seconds" in tags["."]
        groups = board.get("/data/plugin/hparams/session_groups", request=json.dumps(
            {"startIndex": 0, "sliceSize": 10, "allowedStatuses": ["STATUS_UNKNOWN"]}))
        (group,) = groups["sessionGroups"]
        metrics = {m["name"]["tag"]: m["value"] for m in group["metricValues"]}
        for tag, figures in report["links"].items():
            assert metrics[f"final/link/{tag}/exchange_seconds"] == pytest.approx(
                figures["exchange_seconds"], rel=1e-6)
        assert metrics["final/bytes_per_device"] == report["bytes_per_device"]
        assert metrics["final/compression_ratio"] == pytest.approx(report["compression_ratio"])


def test_a_run_of_one_step_reports_no_speed_and_says_so(logdir, caplog):
    """The only step traces the loop: no examples/sec, no compute, no modelled step time
    (null), and one log line saying why; the exchange model per step is still there."""
    caplog.set_level(logging.WARNING)
    summary = mgloop.run(helpers.small_config(logdir, devices="cpu:2", aggregation="ring",
                                              train_steps=1, links=("1gbit,50us",)))
    assert summary["examples_per_sec"] is None and summary["median_step_time"] is None
    assert summary["traced_step_seconds"] > 0
    report = summary["link_model"]
    assert report["compute_seconds"] is None
    figures = report["links"]["1gbit_50us"]
    assert figures["exchange_seconds"] > 0 and figures["step_seconds_no_overlap"] is None
    said = [r.getMessage() for r in caplog.records if "no step time was measured" in r.getMessage()]
    assert len(said) == 1 and "train at least 2 steps" in said[0]
