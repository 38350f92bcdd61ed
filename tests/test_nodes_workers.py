"""Simulated nodes equal real ones: `--nodes=N` in one process against N workers.

Each worker process of a real job (TF_CONFIG, gRPC, collective ops, started by
`mgloop.launch`) is a node; the method between them moves its payloads with
collectives (aggregation/placement/peers.py). In one process, `--nodes=N` splits the towers
into N simulated nodes and the method's transport runs between their leaders. For W = 2
every value the method combines reaches it with the same bits in both (a gather moves
bits; a two-term all-reduce is a_0 + a_1 either way), and each node computes the same
operations, so the weights are EQUAL, bit for bit. For W = 3 the gathered methods stay
bit-equal; a method that all-reduces between workers would differ by the rounding of the
runtime's order of three terms (peers.py), so the three-worker test uses gathered ones.
Bit equality also needs Grappler to rewrite both graphs alike: it does for these
methods; for efsignsgd at 3 nodes its arithmetic optimizer rewrites one graph
differently (the weights then differ by <= 1e-9 after 4 steps; bit-equal with
`arithmetic_optimization` off), so it is not among them.

One job per worker count runs every method in turn in the same worker processes
(tests/workers/methods_between_workers.py), so TensorFlow starts once per worker;
experiments/methods_between_nodes.py workers runs every method so (docs/results/workers.md).
"""

import io
import json
import os
import re
import sys

import keras
import numpy as np
import pytest

import mgloop
from mgloop import launch
from mgloop.runs import export
from tests.workers.methods_between_workers import config_for, digest, hooks_for

WORKER = os.path.join(os.path.dirname(__file__), "workers", "methods_between_workers.py")
# Error feedback, the two all-reduces of P and Q, seeded levels, outer Nesterov steps
# every 4 steps (one sync in the 4 steps: bytes per step a quarter of a sync's), and a
# robust aggregator. The first three are stopped after 2 steps and resumed (SPEC@2): each
# keeps state per node that the resume must read back (residuals, DiLoCo's copies and
# outer step mid-period, PowerSGD's Q), and the resumed job must still equal the
# uninterrupted simulated nodes bit for bit.
# DeMo (the top 32 DCT coefficients of each chunk of up to 64 x 64, 12-bit indices) keeps
# its momentum per node: resumed too. A method that applies momentum itself trains with
# plain SGD (the worker's config_for).
# SparseLoCo gathers its packed payloads: resumed after a sync (each node's own copy and
# error feedback e, not the chief's, then read).
# Streaming DiLoCo with tau=1 (its 4-bit integers summed by a gather) is stopped with
# fragment 0's outer step in flight (sent after step 1, merged after step 2); the eager one,
# its E3M0 codes gathered as packed nibbles (peers.py), with each fragment's delayed share r
# in its nodes' state.
# Centered clipping's centre (its state, the same on every node) is checkpointed by the
# same per-node machinery; its resume is tested in one process (test_clipping_nnm.py).
# SPARTA with DiLoCo's outer step every 4 steps averages the elements drawn from (--seed,
# step, variable) on every worker alike, resumed mid-period after 2 steps (the draw from
# the restored step, the copies and outer state from the nodes' state); SPARTA alone is
# the same exchange without the outer step (test_sparta.py). 1-bit signSGD gathers its
# packed signs, each worker's coins for sign(0) from its own tower's stream (the same
# global tower index as the simulated node's).
# mixed_float16 with top-k: worker 1's first tower (global tower 2) overflows at step 1
# (the worker's OverflowAt hook), so both workers must skip that step (weights, optimizer
# and error feedback unchanged) and halve the scale, agreed through the count that rides
# with the metrics (precision.py). Non-IID clients: the median of the two workers'
# label-Dirichlet shards of digits (partition.py), the same dealing as --nodes=2.
# threshold sends the entries that pass, sizes first: the counts gathered, then values and
# indices padded to the largest count in one CollectiveGatherV2 (bytes counted when run,
# resumed: the run-time totals are the nodes' state too).
# With --towers_per_device=2 (an entry's own settings after its spec) each worker computes
# its 2 devices x 2 towers as one vectorized pass per device, against --nodes=2 over 4
# devices x 2 towers in one process. The ring stays at the towers (an exact method's
# default): each worker sums its devices' means (device_groups.py) and the workers add
# their sums (cross_worker.py), where the simulated nodes sum each node and ring the two
# means; every sum has two terms (a + b = b + a) and the rest are scalings by powers of 2,
# exact, so the bits agree. DiLoCo is at the nodes: each node's sum adds each device's
# rows there first (device_groups.node_sum), in the same order in both.
# The sharded update (--shard_update) at the towers: each worker's 2 copies split the update,
# each chunk summed between the workers by the 2 copies holding it (cross_worker.py), against
# the whole update of the simulated nodes (the same two-term sums, an element-wise update);
# the ring's resumed after 2 steps from the chief's whole optimizer, scattered on every
# worker. And `collective` itself between the workers (each worker's group its own key).
TWO_WORKERS = ["topk:ratio=0.1@2", "diloco:period=4@2", "powersgd@2", "qsgd",
               "centered_clipping:tau=1", "demo@2", "sparta_diloco:fraction=0.05,period=4@2",
               "signsgd:bits=1", "sparseloco:period=2,density=0.1@2",
               "streaming_diloco:period=4,fragments=2,tau=1,outer_bits=4@2",
               "streaming_diloco:period=2,fragments=2,eager=true,outer_format=e3m0@2",
               "threshold:value=0.05@2",
               "topk:ratio=0.1 --mixed_precision=mixed_float16 --overflow=2:1",
               "median --dataset=digits --partition=dirichlet:alpha=0.5",
               "ring --towers_per_device=2", "diloco:period=4 --towers_per_device=2",
               "ring@2 --shard_update=true", "collective --shard_update=true", "collective"]
SHARDED = "--shard_update=true"
# every job on the mlp of one hidden layer (tests/helpers.py's): 4 variables to exchange
SMALLER = ("--mlp_depth=1",)
# synchronous entries: every worker ends with the same weights and loss scale (each
# worker's own, printed by the worker), those of the simulated nodes
EVERY_WORKER_ALIKE = [entry for entry in TWO_WORKERS
                      if "--mixed_precision" in entry or "--partition" in entry]
RESUMED = [entry for entry in TWO_WORKERS if "@" in entry]
# need 3 nodes; run with one attacking node; the second mixes first (nnm.py) between workers
THREE_WORKERS = ["trimmed_mean:trim=1", "trimmed_mean:trim=1,nnm=1"]


def run_job(root, num_workers: int, devices: str, specs: list[str], *settings) -> str:
    out = io.StringIO()
    code = launch.launch(num_workers, devices, [], grace=30.0,
                         command=[sys.executable, WORKER, *settings, str(root), *specs],
                         out=out)
    text = out.getvalue()
    assert code == 0, text[-4000:]
    assert text.count("[methods] done") == num_workers * len(specs), text[-4000:]
    with open(os.path.join(root, "launcher.txt"), "w") as handle:
        handle.write(text)
    return text


def workers_ends(root, index) -> dict:
    """{worker: (its loss scale, digest of its weights)} of entry `index`, as each printed."""
    with open(os.path.join(root, "launcher.txt")) as handle:
        text = handle.read()
    return {int(w): (scale, weights) for w, scale, weights in re.findall(
        rf"\[methods\] done {index} .*\| worker=(\d+) loss_scale=(\S+) weights=(\w+)", text)}


def weights(root, index):
    return keras.models.load_model(
        os.path.join(root, str(index), "export", export.EXPORT_FILENAME)).get_weights()


def between_gradients(root, index) -> dict:
    """The chief's gradient traffic between nodes per step (summary.json)."""
    with open(os.path.join(root, str(index), "summary.json")) as handle:
        return json.load(handle)["link_model"]["tiers"]["between"]["gradient"]


def check_equal_to_simulated(tmp_path, root, specs, devices, nodes, **overrides):
    """Weights bit-equal; the bytes a node sends between nodes per step equal the simulated
    node's, but for the < 4 bytes by which peers.py pads each gathered buffer to int32s
    per message."""
    for index, entry in enumerate(specs):
        head, *own = entry.split()  # a resumed job against the uninterrupted nodes
        spec = " ".join([head.partition("@")[0], *own])
        # a sharded update between workers against the whole update of the simulated nodes:
        # each chunk is the same two-term sum, and the update is element-wise
        simulated = " ".join(word for word in spec.split() if word != SHARDED)
        result = mgloop.run(config_for(simulated, str(tmp_path / "single"), index, devices,
                                       nodes=nodes, **overrides),
                            hooks=hooks_for(simulated, devices))
        if entry in EVERY_WORKER_ALIKE:
            expected = (str(result.trainer.loss_scale()), digest(result))
            assert workers_ends(root, index) == {w: expected for w in range(nodes)}, spec
            if "--overflow" in spec:  # one skipped step: the scale halved once, on each
                assert expected[0] == str(2.0 ** 14), spec
        real, simulated = weights(root, index), weights(tmp_path / "single", index)
        if "eager=true" in spec:  # the exports differ by design: the simulated nodes' mean
            # of the x_c; between workers the chief's own x_c (that mean needs a collective:
            # docs/methods/local-updates.md), which the simulated node 0 holds
            with open(os.path.join(root, str(index), "summary.json")) as handle:
                assert json.load(handle)["evaluated_model"].startswith("node 0's own outer")
            simulated = [v.numpy() for v in result.trainer.aggregation.inner._start[0]]
        assert len(real) == len(simulated)
        for a, b in zip(real, simulated):
            np.testing.assert_array_equal(a, b, err_msg=spec)
        sent = between_gradients(root, index)
        expected = between_gradients(tmp_path / "single", index)["bytes_per_device"]
        # (a sharded node sends its chunks from each of its devices: the node's sum counts)
        node = sent["bytes_sent"] if SHARDED in spec.split() else sent["bytes_per_device"]
        assert expected <= node <= expected + 3 * sent["messages_per_device"], (spec, sent,
                                                                                expected)
        if spec == "diloco:period=4":  # one sync of every parameter in 4 steps
            with open(os.path.join(root, str(index), "summary.json")) as handle:
                report = json.load(handle)["link_model"]
            assert report["where"] == "between nodes" and report["syncs"]["sync"][
                "occurrences"] == 1
            # a dense ring between 2 nodes moves G bytes, a sync the same (but the < 4 B of
            # padding per message), so the gradient ratio per step is 4
            assert report["compression_ratio"] == pytest.approx(4.0, rel=1e-4)


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_workers")
    run_job(root, 2, "cpu:2", TWO_WORKERS, *SMALLER)
    return root


# the two tests on `two_workers` run in one process (--dist loadgroup), so its job runs once
@pytest.mark.xdist_group("nodes_two_workers")
def test_two_workers_equal_two_simulated_nodes(two_workers, tmp_path):
    check_equal_to_simulated(tmp_path, two_workers, TWO_WORKERS, "cpu:4", 2, mlp_depth=1)


@pytest.mark.xdist_group("nodes_two_workers")
def test_a_resumed_job_restores_every_nodes_own_state(two_workers):
    """2 steps, then a new run to step 4 from the checkpoint of step 2 (the chief's, and
    each worker's node-<w> state beside it): a run started again, not from scratch, whose
    weights the test above finds bit-equal to the uninterrupted simulated nodes'; without
    the nodes' own state they would not be (error feedback, DiLoCo's copies and outer state
    before its sync at step 4)."""
    for entry in RESUMED:
        index = TWO_WORKERS.index(entry)
        with open(two_workers / str(index) / "summary.json") as handle:
            assert json.load(handle)["start_step"] == 2, entry  # resumed, not started again
        if SHARDED in entry.split():  # at the towers: the chief's checkpoint alone
            continue
        for node in ("node-0", "node-1"):
            saved = sorted(os.listdir(two_workers / str(index) / "checkpoints" / node))
            assert {"ckpt-2.index", "ckpt-4.index"} <= set(saved), (entry, saved)


def test_three_workers_equal_three_simulated_nodes(tmp_path):
    """With --byzantine_towers=1: one of the 3 nodes (workers) sends the sign-flipped
    gradient, the same one, with the same draw, as among 3 simulated nodes."""
    root = tmp_path / "three_workers"
    run_job(root, 3, "cpu:1", THREE_WORKERS, "--global_batch_size=96", "--byzantine_towers=1",
            *SMALLER)
    check_equal_to_simulated(tmp_path, root, THREE_WORKERS, "cpu:3", 3, global_batch_size=96,
                             byzantine_towers=1, mlp_depth=1)
