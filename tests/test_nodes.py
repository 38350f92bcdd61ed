"""Nodes (placement/between_nodes.py): the method between simulated nodes of one process.

The gradients here are dyadic (k/8, |k| < 64): a node's sum and its halving are exact in
float32, so the method between N nodes must give, bit for bit, what the same method gives
N towers handed those node means (the same seeds: the node index is the tower index).
Also: local steps keep one copy per node, the traffic splits within/between nodes and
gradient/state exactly, the two-tier link model, attackers per node, the refusals.
"""

import json

import numpy as np
import pytest
import tensorflow as tf

import mgloop
from mgloop import aggregation, settings
from mgloop.aggregation import checks as exchange_checks
from mgloop.aggregation import node_settings
from mgloop.aggregation.compression.topk import kept
from mgloop.aggregation.placement import between_nodes as nodes_lib
from mgloop.aggregation.traffic import Traffic
from mgloop.cluster import devices
from mgloop.errors import ConfigError
from mgloop.observe import link_model
from mgloop.runs.config import Config
from mgloop.step import replicas
from mgloop.step.hooks.attack_hook import ByzantineTowers
from mgloop.step.hooks.attacks import parse_attack
from tests import helpers, tolerance

SHAPES = [(3, 5), (11,), (1,)]

# (spec, nodes of the 4 towers): every method that runs between nodes; the robust
# aggregators that need 3 or more participants on 4 one-tower nodes.
METHODS = [
    ("reduce_broadcast", 2), ("ring", 2), ("collective", 2), ("ps_cpu", 2),
    ("topk:ratio=0.3", 2), ("randomk:ratio=0.3", 2), ("threshold:value=1", 2),
    ("dgc:ratio=0.3,momentum=0.5", 2), ("qsgd:levels=4", 2), ("terngrad", 2), ("onebit", 2),
    ("signsgd", 2), ("signsgd:bits=1", 2), ("efsignsgd", 2), ("powersgd:rank=1", 2), ("localsgd:period=2", 2),
    ("diloco:period=2", 2), ("sparta", 2), ("sparta_diloco", 2), ("delay:d=1", 2), ("drop:k=1", 2), ("adasum", 2),
    ("median", 2), ("trimmed_mean:trim=0", 2), ("geomedian", 2), ("independent", 2),
    ("centered_clipping", 2), ("krum:f=0", 4), ("multikrum:f=0,m=2", 4), ("bulyan:f=0", 4),
    ("krum:f=0,nnm=1", 4)]


def dyadic_gradients(towers, seed):
    rng = np.random.default_rng(seed)
    return [[(rng.integers(-63, 64, size=s) / 8.0).astype(np.float32) for s in SHAPES]
            for _ in range(towers)]


def placed(device_names, values):
    out = []
    for device, per_tower in zip(device_names, values):
        with tf.device(device):
            out.append([tf.constant(g) for g in per_tower])
    return out


def config_of(spec, nodes, **more):
    """The exchange part of a run of `spec` between `nodes` nodes of cpu:4."""
    return Config(aggregation=spec, devices="cpu:4", nodes=nodes, **more).exchange


def built(method, variables):
    method.build(variables)
    return method


@pytest.mark.parametrize("spec, nodes", METHODS)
def test_the_method_between_nodes_is_the_method_on_the_node_means(spec, nodes):
    """Three steps (state carried): every tower of node n holds what the method on N
    towers gives its tower n, bit for bit; the method's state is one per node."""
    device_set = devices.setup(devices.parse("cpu:4"))
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    step = replicas.global_step_on(device_set.host)  # both methods read it
    at_nodes = built(nodes_lib.make(config_of(spec, nodes), device_set, aggregation.make,
                                    step_counter=step), variables)
    assert isinstance(at_nodes, nodes_lib.NodeLevel) and at_nodes.num_towers == 4
    alone = built(aggregation.make(spec, devices.setup(devices.parse(f"cpu:{nodes}")),
                                   step_counter=step), variables)
    assert len(at_nodes.state_variables) == len(alone.state_variables)
    per_node = 4 // nodes
    # compiled, as in a step (collective ops, e.g., need a function to run in)
    reduce_at_nodes, reduce_alone = tf.function(at_nodes.reduce), tf.function(alone.reduce)
    for s in range(3):
        values = dyadic_gradients(4, seed=s)
        means = [[sum(values[t][i] for t in range(n * per_node, (n + 1) * per_node)) / per_node
                  for i in range(len(SHAPES))] for n in range(nodes)]
        got = reduce_at_nodes(placed(device_set.towers, values), variables)
        expected = reduce_alone(placed(alone.devices.towers, means), variables)
        for copy, values_of_copy in enumerate(got):
            replicated = at_nodes.capabilities.layout == "replicated"
            reference = expected[copy // per_node if replicated else 0]
            for a, b in zip(values_of_copy, reference):
                np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=f"{spec} step {s}")
        step.assign_add(1)


def test_grad_reduce_sum_is_the_mean_times_the_towers():
    device_set = devices.setup(devices.parse("cpu:4"))
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    method = built(nodes_lib.make(config_of("ring", 2), device_set, aggregation.make,
                                  step_counter=replicas.global_step_on(device_set.host)),
                   variables)
    values = placed(device_set.towers, dyadic_gradients(4, seed=9))
    mean, total = method.reduce(values, variables), method.reduce(values, variables, False)
    for a, b in zip(mean[3], total[3]):
        np.testing.assert_array_equal(4 * a.numpy(), b.numpy())


def test_traffic_is_split_within_and_between_nodes_exactly():
    """topk at 2 nodes of 2 towers: inside a node the follower sends its dense gradient to
    the leader and gets the result back (4n bytes each way); between the nodes each leader
    sends its k float32 values and k uint8 indices (n <= 256) to the other (5k bytes)."""
    device_set = devices.setup(devices.parse("cpu:4"))
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    method = built(nodes_lib.make(config_of("topk:ratio=0.3", 2), device_set, aggregation.make,
                                  step_counter=replicas.global_step_on(device_set.host)),
                   variables)
    with method.step():
        method.reduce(placed(device_set.towers, dyadic_gradients(4, seed=1)), variables)
    tiers = method.traffic.tiers_as_dict()
    dense = sum(4 * int(np.prod(s)) for s in SHAPES)
    payload = sum(5 * kept(0.3, int(np.prod(s))) for s in SHAPES)  # uint8 indices
    assert tiers["within"]["gradient"] == {"bytes_per_device": dense, "bytes_sent": 4 * dense,
                                           "messages_per_device": len(SHAPES)}
    assert tiers["between"]["gradient"]["bytes_per_device"] == payload
    assert tiers["between"]["gradient"]["bytes_sent"] == 2 * payload
    # the three variables' wires fit one bucket of --pack_bytes: one message between nodes
    assert tiers["between"]["gradient"]["messages_per_device"] == 1
    assert tiers["within"]["state"]["bytes_sent"] == tiers["between"]["state"]["bytes_sent"] == 0


@pytest.mark.parametrize("pack_bytes, messages", [(0, 2 * len(SHAPES)), (30, 3), (10**6, 1)])
def test_buckets_fuse_the_gathered_wires_into_fewer_messages_of_the_same_bytes(pack_bytes,
                                                                                messages):
    """topk at 2 nodes: with --pack_bytes=0 each variable's values and indices are sent
    apart (2 messages per variable); in buckets of 30 bytes the first variable's wire
    (5 k = 25 bytes) travels alone, part by part (2 messages), the other two (20 + 5
    bytes) share one; one bucket holds all three.
    The bytes and the results are the same, bit for bit."""
    device_set = devices.setup(devices.parse("cpu:4"))
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    outputs = []
    for bucket in (pack_bytes, 0):
        method = built(nodes_lib.make(config_of("topk:ratio=0.3", 2, pack_bytes=bucket),
                                      device_set, aggregation.make,
                                      step_counter=replicas.global_step_on(device_set.host)),
                       variables)
        with method.step():
            outputs.append(method.reduce(placed(device_set.towers,
                                                dyadic_gradients(4, seed=2)), variables))
        if bucket == pack_bytes:
            between = method.traffic.tiers_as_dict()["between"]["gradient"]
    assert between["messages_per_device"] == messages
    assert between["bytes_per_device"] == sum(5 * kept(0.3, int(np.prod(s))) for s in SHAPES)
    for got, expected in zip(*outputs):
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_an_exact_method_between_nodes_equals_one_device(tmp_path):
    """ring between 2 nodes of 2 towers (node sums, then the ring between the leaders, then
    the broadcast), momentum, 5 steps: every copy and the loss sum within the float32 bound
    of the one-device run (tests/tolerance.py: any summation order lies within it)."""
    config = helpers.small_config(str(tmp_path), devices="cpu:4", nodes=2, aggregation="ring")
    trainer = helpers.build_trainer(config)
    batches = helpers.batches(5)
    loss_sum = helpers.run_batches(trainer, batches)
    expected = helpers.train_reference_bounded(config, batches)
    for weights in helpers.copy_weights(trainer):
        tolerance.assert_matches_reference(weights, loss_sum, expected)


def test_local_steps_keep_one_copy_per_node(tmp_path):
    """diloco:period=2 between 2 nodes of 2 towers: inside a node the copies are equal bit
    for bit at every step; the two nodes' copies differ after an inner step and are equal
    again after the outer step; the summary reports bytes between nodes."""
    config = helpers.small_config(str(tmp_path), devices="cpu:4", nodes=2,
                                  aggregation="diloco:period=2", optimizer="sgd")
    trainer = helpers.build_trainer(config)
    batches = helpers.batches(3)
    for steps, nodes_equal in ((batches[:1], False), (batches[1:2], True),
                               (batches[2:3], False)):
        helpers.run_batches(trainer, steps)
        copies = helpers.copy_weights(trainer)
        for a, b in ((0, 1), (2, 3)):
            for x, y in zip(copies[a], copies[b]):
                np.testing.assert_array_equal(x, y)
        same = all(np.array_equal(x, y) for x, y in zip(copies[0], copies[2]))
        assert same == nodes_equal


def test_a_run_between_nodes_reports_both_tiers_and_the_two_tier_model(tmp_path):
    summary = mgloop.run(helpers.small_config(
        str(tmp_path / "run"), devices="cpu:4", nodes=2, aggregation="topk:ratio=0.1",
        train_steps=2, steps_per_loop=2,
        links=("within:100gbit,2us", "between:10gbit,50us", "between:1gbit,50us")))
    with open(tmp_path / "run" / "summary.json") as handle:
        report = json.load(handle)["link_model"]
    assert report == summary["link_model"]
    tiers = report["tiers"]
    assert tiers["nodes"] == 2 and tiers["between"]["gradient"]["bytes_per_device"] > 0
    assert tiers["compression_ratio_between"] == pytest.approx(
        tiers["dense_ring_bytes_between"] / tiers["between"]["gradient"]["bytes_per_device"])
    assert tiers["compression_ratio_between"] > 4  # top 10%: values and indices, gathered
    assert sorted(report["links"]) == ["between_10gbit_50us", "between_1gbit_50us"]
    slow, fast = report["links"]["between_1gbit_50us"], report["links"]["between_10gbit_50us"]
    assert slow["within"] == fast["within"] == "100gbit,2us"
    assert slow["exchange_seconds"] > fast["exchange_seconds"] > 0


def test_the_two_tier_model_adds_the_within_and_the_between_stage():
    traffic = Traffic(node_of={"CPU:0": 0, "CPU:1": 0, "CPU:2": 1})
    traffic.record("CPU:1", "CPU:0", 1000)  # within node 0
    traffic.record("CPU:0", "CPU:2", 500)  # between
    traffic.record("CPU:2", "CPU:0", 500)
    with traffic.counting_state():
        traffic.record("CPU:0", "CPU:2", 8)
    within = link_model.parse("within:8kbit,1ms")  # 1000 bytes/s
    between = link_model.parse("between:4kbit,2ms")  # 500 bytes/s
    assert (within.tier, between.tier, between.tag) == ("within", "between",
                                                        "between_4kbit_2ms")
    # within: 1 message of 1000 bytes on CPU:0 and CPU:1; between: CPU:0 sends 2 messages
    # (508 bytes) and receives 1 (500 bytes)
    expected = (1e-3 + 1000 / 1000) + (2 * 2e-3 + 508 / 500)
    assert link_model.tiered_exchange_seconds(traffic, within, between) == pytest.approx(
        expected, rel=1e-12)
    tiers = traffic.tiers_as_dict()
    assert tiers["between"]["state"] == {"bytes_per_device": 8, "bytes_sent": 8,
                                         "messages_per_device": 1}
    assert tiers["between"]["gradient"]["bytes_sent"] == 1000


def test_attackers_are_whole_nodes():
    hook = ByzantineTowers(parse_attack("gaussian:std=1"), 1, "fixed", 0,
                           tf.Variable(0, dtype=tf.int64), 0, 4, "/device:CPU:0",
                           towers_per_unit=2)
    g = [tf.ones([5])]
    with hook.step_scope():
        flags = hook.flags().numpy()
        outs = [hook.unscale(t, g)[0].numpy() for t in range(4)]
    np.testing.assert_array_equal(flags, [1, 1, 0, 0])
    np.testing.assert_array_equal(outs[0], outs[1])  # one draw per node: its mean is it
    assert not np.array_equal(outs[0], g[0].numpy())
    np.testing.assert_array_equal(outs[2], g[0].numpy())


@pytest.mark.parametrize("settings, message", [
    (dict(nodes=0), "--nodes=0 is out of range: must be >= 1"),
    (dict(nodes=2, within_node="nosuch"), "--within_node=nosuch is not an exact replicated "
                                          "method; use reduce (the default) or one of:"),
    (dict(nodes=3), "--nodes=3 does not divide the 4 towers into equal nodes; use one of: "
                    "1, 2, 4"),
    (dict(nodes=1, method_at="nodes"), "--method_at=nodes with --nodes=1"),
    (dict(nodes=2, aggregation="krum:f=0"), "--aggregation=krum:nnm=0,f=0 between nodes "
                                            "needs at least 3 nodes (2f + 3 = 3 for f=0); "
                                            "--nodes=2 gives 2 nodes: use --nodes=4 or "
                                            "--method_at=towers (the method then sees the 4 "
                                            "towers)"),
    (dict(nodes=2, within_node="topk"), "--within_node=topk is not an exact replicated "
                                        "method"),
    (dict(nodes=2, method_at="towers", within_node="ring"), "--within_node=ring applies "
                                                            "only"),
    (dict(nodes=2, aggregation="colocate"), "none per node"),
    (dict(nodes=2, byzantine_towers=2), "the nodes (the method is between nodes)"),
    (dict(nodes=2, method_at="both"), "--method_at='both' is not one of"),
    (dict(links=("between:10gbit,50us",)), "needs the link inside a node too"),
    (dict(links=("within:10gbit,50us",)), "needs a link between nodes"),
    (dict(links=("within:1gbit,5us", "within:2gbit,5us", "between:1gbit,5us")),
     "is given 2 times"),
])
def test_node_settings_that_do_not_apply_are_refused_in_one_line(settings, message, logdir):
    with pytest.raises(ConfigError) as error:
        helpers.small_config(logdir, **{"devices": "cpu:4", **settings}).validated()
    assert message in str(error.value) and "\n" not in str(error.value)


def test_between_workers_only_methods_whose_transports_reach_other_processes():
    """At the nodes across workers the method has one tower per process: a method that
    moves values only with `send` between its own towers (the plugin topk_ef,
    reduce_broadcast) would exchange nothing, so --method_at=nodes is refused in one line
    and auto keeps it at the towers (its dense local sums added between the workers)."""
    import types
    aggregation.load_plugins(["tests.plugins.topk_ef"])
    workers = types.SimpleNamespace(num_workers=2)
    for spec in ("topk_ef:ratio=0.5", "reduce_broadcast"):
        config = Config(aggregation=spec, devices="cpu:2", method_at="nodes",
                        plugins=("tests.plugins.topk_ef",))
        with pytest.raises(ConfigError) as error:
            exchange_checks.check(config.exchange, settings.Context(
                request=devices.parse("cpu:2"), workers=workers, num_workers=2))
        message = str(error.value)
        assert "\n" not in message and "runs_between_processes" in message, message
        assert "--method_at=towers" in message and "topk," in message, message
        auto = Config(aggregation=spec, devices="cpu:2", plugins=("tests.plugins.topk_ef",))
        assert not node_settings.method_at_nodes(auto.exchange, 2)
    assert node_settings.method_at_nodes(Config(aggregation="topk", devices="cpu:2").exchange, 2)
