"""Elastic jobs: a worker killed mid-run, the others continue, the slot rejoins.

`python -m mgloop.launch --elastic` (mgloop/cluster/elastic.py) restarts a job in rounds
from its last complete checkpoint; runs/node_checkpoint.py re-deals the nodes' own state
when a round has another worker count. The rules are checked on hand-made variables in
one process; one real 3-worker DiLoCo job is killed with SIGKILL and must finish.
"""

import io
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import types

import numpy as np
import pytest
import tensorflow as tf

import mgloop
from mgloop import launch
from mgloop.aggregation.capabilities import Capabilities
from mgloop.aggregation.compression.base import Compressed
from mgloop.aggregation.local.local_steps import DiLoCo
from mgloop.cluster import elastic
from mgloop.data import options as data_options
from mgloop.errors import ConfigError
from mgloop.runs import node_checkpoint

OPTIONS = elastic.ElasticOptions(min_workers=2, max_restarts=1, rejoin_seconds=0.0,
                                 logdir="/tmp/run")


@pytest.mark.parametrize("options,flags,expected", [
    (dict(min_workers=4), [], "--min_workers=4 is out of range: must be 1..3"),
    (dict(min_workers=0), [], "--min_workers=0 is out of range"),
    (dict(max_restarts=-1), [], "--max_restarts=-1 is out of range: must be >= 0"),
    (dict(rejoin_seconds=float("nan")), [], "--rejoin_seconds=nan is out of range"),
    (dict(logdir=""), [], "--elastic needs --logdir=DIR after --"),
    (dict(), ["--global_batch_size=64"], "--global_batch_size=64 does not split over 3 workers"),
    (dict(), [], "--global_batch_size=128 does not split over 3 workers"),  # the default
])
def test_elastic_settings_are_refused_in_one_line(options, flags, expected):
    problem = elastic.refusal(OPTIONS.__class__(**{**OPTIONS.__dict__, **options}), 3, flags,
                              towers_per_worker=2,
                              default_global_batch=data_options.DEFAULT_GLOBAL_BATCH_SIZE)
    assert problem is not None and expected in problem and "\n" not in problem


def test_a_batch_that_splits_at_every_count_or_scales_is_accepted():
    assert elastic.refusal(OPTIONS, 3, ["--global_batch_size=12"], 2, 128) is None  # 2x2, 3x2
    assert elastic.refusal(OPTIONS, 3, ["--batch_size_per_tower=5"], 2, 128) is None
    assert elastic.refusal(OPTIONS, 3, [], 2, 12) is None  # the default given, split
    assert launch.towers_per_worker("cpu:2", ["--towers_per_device=3"]) == 6
    assert launch.towers_per_worker("gpu:0,1", []) == 2
    assert launch.towers_per_worker("auto", []) is None


class _Joining:
    """A method stand-in: what `rejoined` was given, and an optional refusal."""
    name = "stand_in"

    def __init__(self, refusal=None):
        self.capabilities = Capabilities(layout="replicated", resize_refusal=refusal)
        self.joined = []

    def rejoined(self, copies):
        self.joined.append(copies)


def _nodes(tmp_path, count, step=10):
    """`count` node checkpoints of step `step`, node w holding the value w + 1."""
    for w in range(count):
        variable = tf.Variable(np.full([3], w + 1.0, np.float32))
        node_checkpoint.NodeCheckpoints(str(tmp_path), w, [variable], keep=2,
                                        count=count).save(step)


def _restore(tmp_path, index, count, method=None, step=10):
    variable = tf.Variable(np.zeros([3], np.float32))
    saver = node_checkpoint.NodeCheckpoints(str(tmp_path), index, [variable], keep=2,
                                            count=count)
    said = saver.restore(step, "LOGDIR", method, copies=("copies",))
    return variable.numpy()[0], said


def test_a_resize_keeps_the_survivors_state_and_a_joiner_takes_node_0s(tmp_path):
    _nodes(tmp_path, 3)
    assert node_checkpoint.incomplete(str(tmp_path), 10) is None
    assert _restore(tmp_path, 1, 3) == (2.0, "")  # same count: its own, nothing to say
    value, said = _restore(tmp_path, 1, 2)  # 3 -> 2: node 1 keeps its own; node 2 dropped
    assert value == 2.0 and "node 1 keeps its state of step 10 (3 workers wrote it" in said
    method = _Joining()
    value, said = _restore(tmp_path, 3, 4, method)  # 3 -> 4: node 3 joins with node 0's
    assert value == 1.0 and method.joined == [("copies",)] and "node 3 joins" in said
    with pytest.raises(ConfigError, match=r"step 10 was written by 3 workers .* this run has "
                                          r"2, and --aggregation=stand_in cannot re-deal .*: "
                                          r"no rule; resume with 3 workers"):
        _restore(tmp_path, 0, 2, _Joining("no rule"))
    assert _restore(tmp_path, 0, 3, _Joining("no rule"))[0] == 1.0  # same count: allowed


def test_a_step_missing_a_nodes_part_is_incomplete(tmp_path):
    _nodes(tmp_path, 3, step=20)
    _nodes(tmp_path, 2, step=30)  # node 2 of 3 never wrote step 30: written as 2 would be
    os.remove(tmp_path / "node-1" / "ckpt-30.index")
    assert "node(s) node-1 of the 2 that wrote step 30 have no ckpt-30" in (
        node_checkpoint.incomplete(str(tmp_path), 30))
    os.remove(tmp_path / "node-0" / "ckpt-20.index")
    assert node_checkpoint.incomplete(str(tmp_path), 20) == "node-0 has no ckpt-20"
    assert node_checkpoint.incomplete(str(tmp_path), 40) is None  # no node state at all


def test_a_joining_diloco_node_starts_from_x_and_a_compressor_from_no_memory():
    copy = types.SimpleNamespace(device="/cpu:0", trainable=[tf.Variable([5.0, 6.0])])
    stand_in = types.SimpleNamespace(_start=[[tf.Variable([1.0, 2.0])]])
    DiLoCo.rejoined(stand_in, [copy])
    np.testing.assert_array_equal(copy.trainable[0].numpy(), [1.0, 2.0])
    momentum, q = tf.Variable([3.0]), tf.Variable([4.0])
    residual = tf.Variable([7.0, 8.0])
    compressor = types.SimpleNamespace(steps=[tf.Variable(9)], residuals=[[residual]],
                                       extra=[[{"momentum": momentum, "q": q}]],
                                       own_state_keys=("momentum",))
    Compressed.rejoined(compressor, [copy])
    assert residual.numpy().tolist() == [0, 0] and momentum.numpy().tolist() == [0]
    assert q.numpy().tolist() == [4.0] and int(compressor.steps[0].numpy()) == 9  # shared


JOINING_WORKER = os.path.join(os.path.dirname(__file__), "workers", "joining_nodes.py")
# DiLoCo stopped 2 inner steps after its outer step at 4 (copies away from x), top-k with
# its residuals, and eager Streaming DiLoCo, which has no rule to re-deal its nodes' state
JOINING = ["diloco:period=4", "topk:ratio=0.1",
           "streaming_diloco:period=2,fragments=2,eager=true,outer_format=e3m0"]


def _joining_job(root, num_workers: int) -> str:
    out = io.StringIO()
    code = launch.launch(num_workers, "cpu:1", [], grace=30.0, out=out, command=[
        sys.executable, JOINING_WORKER, "--train_steps=6", "--global_batch_size=96",
        str(root), *JOINING])
    assert code == 0, out.getvalue()[-4000:]
    return out.getvalue()


def _states(text: str, index: int) -> dict:
    return {int(w): (float(d), float(m)) for w, d, m in re.findall(
        rf"\[joining\] state {index} .*\| worker=(\d+) drift=(\S+) memory=(\S+)", text)}


def test_a_node_joining_a_resized_job_takes_the_documented_state(tmp_path):
    """The real objects through a real resize: 2 workers train 6 steps and save; 3 workers
    resume the same logdirs at step 6 (nothing left to train, so each trainer holds what
    the restore re-dealt through the cross-worker stage and the node-level wrapper).
    The survivors keep their own state; the joining node 2 starts DiLoCo's copies from x
    and top-k's error feedback from 0 (node 0's state, then `rejoined`), where node 0's are
    not; eager Streaming DiLoCo is refused in one line on every worker."""
    first = _joining_job(tmp_path, 2)
    resumed = _joining_job(tmp_path, 3)
    diloco, topk = _states(first, 0), _states(first, 1)
    assert diloco[0][0] > 0 and topk[0][1] > 0, first[-4000:]  # node 0's own, to be reset
    joined_diloco, joined_topk = _states(resumed, 0), _states(resumed, 1)
    assert sorted(joined_diloco) == sorted(joined_topk) == [0, 1, 2], resumed[-4000:]
    for node in (0, 1):  # the survivors: their own state, as saved
        assert joined_diloco[node][0] == diloco[node][0], (joined_diloco, diloco)
        assert joined_topk[node][1] == topk[node][1], (joined_topk, topk)
    assert joined_diloco[2][0] == 0.0, joined_diloco  # the joiner's copies at x
    assert joined_topk[2][1] == 0.0, joined_topk  # and no error feedback of node 0's
    refusals = re.findall(r"\[joining\] refused 2 streaming_diloco\S*: (.*)", resumed)
    assert len(refusals) == 3 and "written by 2 workers" in refusals[0], resumed[-4000:]
    assert "eager's delayed shares" in refusals[0] and "resume with 2 workers" in refusals[0]


DILOCO = ["--aggregation=diloco:period=8", "--model=mlp", "--dataset=digits",
          "--global_batch_size=96", "--train_steps=300", "--steps_per_loop=4",
          "--summary_every=0", "--eval_every=0", "--log_every=0", "--learning_rate=0.05"]


def _accuracy_of_simulated_nodes(seed, logdir, **failures):
    """The eval accuracy of the same run on 3 simulated nodes in one process."""
    flags = dict(f[2:].split("=", 1) for f in DILOCO)
    flags["steps_per_loop"] = "100"  # the same steps in fewer calls
    config = mgloop.Config(**{k: (int(v) if v.isdigit() else float(v) if k == "learning_rate"
                                  else v) for k, v in flags.items()},
                           devices="cpu:3", nodes=3, seed=seed, checkpoint_every=0,
                           logdir=str(logdir), diagnostics=False, **failures)
    return mgloop.run(config).summary["eval_accuracy"]


def test_a_killed_worker_is_replaced_and_the_job_finishes(tmp_path):
    """3 workers of DiLoCo (H = 8, a checkpoint every 20 steps: mid-period); worker 2 is
    killed with SIGKILL once step 40 is saved. The launcher continues with 2 workers from
    the last complete checkpoint, takes the third back once they have saved a newer one,
    and the job ends at its step count with an eval accuracy within the spread of the
    unfailed run's seeds (3 simulated nodes in one process, seeds 0..4, the job's among
    them: from their lowest - 3 sd to their highest + 3 sd; one seed's accuracy may lie
    several sd of the others away), widened by 3 binomial standard errors of an accuracy
    p on the n eval examples, sqrt(p (1 - p) / n): a failed job is not a draw from the
    unfailed runs (it trains steps again, its joiner restarts from x, and where the kill
    lands varies run to run), and one example is 1/n of accuracy (n = 297), as
    does the same failure simulated in one process (--node_failures: node 2 down for the
    steps the real job ran on 2 workers, back with a live node's state)."""
    logdir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "mgloop.launch", "--num_workers=3", "--devices_per_worker=cpu:1",
         "--elastic", "--min_workers=2", "--max_restarts=1", "--rejoin_seconds=0", "--",
         f"--logdir={logdir}", "--checkpoint_every=20", *DILOCO],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    saved = logdir / "checkpoints" / "ckpt-40.index"
    while not saved.exists() and process.poll() is None:
        threading.Event().wait(0.05)
    pid = next(int(m.group(1)) for m in (re.match(r"\[launch\] worker 2 .*\(pid (\d+)\)", line)
                                         for line in list(lines)) if m)
    os.kill(pid, signal.SIGKILL)
    process.wait(timeout=600)  # a hang guard only
    reader.join(timeout=10)
    output = "".join(lines)
    assert process.returncode == 0, output[-4000:]
    rounds = [(int(m.group(1)), int(m.group(2))) for m in re.finditer(
        r"\[launch\] round of (\d) worker\(s\) from the checkpoint of step (\d+)", output)]
    assert [count for count, _ in rounds] == [3, 2, 3], output[-4000:]
    assert 40 <= rounds[1][1] < rounds[2][1] < 300, rounds  # the 2 workers advanced
    assert "[launch] worker 2 was killed by signal SIGKILL" in output, output[-4000:]
    assert re.search(r"\[worker 2\] .*node 2 joins: node 0's state of step "
                     f"{rounds[2][1]}", output), output[-4000:]
    final = [float(m.group(1)) for m in re.finditer(
        r"\[worker 0\] .*final: .* eval accuracy ([0-9.]+)", output)]
    assert len(final) == 1, output[-4000:]
    unfailed = [_accuracy_of_simulated_nodes(seed, tmp_path / str(seed)) for seed in range(5)]
    p, n = float(np.mean(unfailed)), 297  # digits' eval split
    widened = 3 * np.std(unfailed) + 3 * np.sqrt(p * (1 - p) / n)
    low, high = min(unfailed) - widened, max(unfailed) + widened
    assert min(unfailed) > 0.5  # far from chance (0.1): the spread says something
    assert low <= final[0] <= high, (final, unfailed)
    down = f"2@{rounds[1][1]}-{rounds[2][1]}"
    simulated = _accuracy_of_simulated_nodes(1, tmp_path / "failures", node_failures=down)
    assert low <= simulated <= high, (simulated, down, unfailed)


def test_each_node_rescues_its_part_and_a_lost_logdir_is_not_recreated(tmp_path):
    """Every worker saves its node's part of a rescue into the folder they agree on
    (run_end.rescue_saver); a node save into a deleted logdir refuses instead of letting
    TensorFlow recreate it (which would hide the loss from the chief's guard)."""
    logdir = tmp_path / "run"
    for w in range(2):
        variable = tf.Variable(np.full([3], w + 1.0, np.float32))
        saver = node_checkpoint.NodeCheckpoints(str(logdir / "checkpoints"), w, [variable],
                                                keep=1, count=2)
        saver.save_into(str(tmp_path / "rescued" / "checkpoints"), 7)
    assert node_checkpoint.incomplete(str(tmp_path / "rescued" / "checkpoints"), 7) is None
    assert _restore(tmp_path / "rescued" / "checkpoints", 1, 2, step=7)[0] == 2.0
    shutil.rmtree(logdir, ignore_errors=True)
    with pytest.raises(FileNotFoundError, match="is gone"):
        saver.save(8)
    assert not logdir.exists()
