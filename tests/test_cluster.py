"""TF_CONFIG parsing, peer checks and the launcher's reporting (no second process needed)."""

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from mgloop import launch
from mgloop.cluster import worker_processes
from mgloop.cluster import workers as cluster
from mgloop.errors import ConfigError
from tests.launcher_output import Lines


def config(workers, index, **extra):
    spec = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
    spec["cluster"].update(extra)
    return {"TF_CONFIG": json.dumps(spec)}


def test_no_tf_config_is_a_single_process():
    assert cluster.from_environment({}) is None


def test_tf_config_names_the_workers_and_the_chief():
    found = cluster.from_environment(config(["a:1", "b:2"], 1))
    assert found == cluster.Cluster(("a:1", "b:2"), 1)
    assert not found.is_chief and found.num_workers == 2
    assert found.task() == "/job:worker/replica:0/task:1"


@pytest.mark.parametrize("environ,pattern", [
    ({"TF_CONFIG": "{not json"}, r"^TF_CONFIG is not usable \(JSONDecodeError"),
    (config(["a:1"], 3), r"^TF_CONFIG: task must be .*index.*0\.\.\.0"),
    (config(["a"], 0), r"^TF_CONFIG: cluster.worker must be a list of 'host:port'"),
    (config(["a:1"], 0, ps=["p:3"]), r"^TF_CONFIG has job\(s\) ps; mgloop runs only 'worker'"),
])
def test_bad_tf_config_is_one_clear_line(environ, pattern):
    with pytest.raises(ConfigError, match=pattern) as error:
        cluster.from_environment(environ)
    assert "\n" not in str(error.value)


def test_unreachable_peer_is_named_within_the_wait():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    me = cluster.Cluster(("127.0.0.1:1", f"127.0.0.1:{port}"), 0)
    began = time.monotonic()
    with pytest.raises(ConfigError, match=rf"^TF_CONFIG: worker 1 at 127.0.0.1:{port} is not "
                                          r"reachable after 2s"):
        cluster.wait_for_peers(me, timeout=2)
    assert time.monotonic() - began < 10


def test_reachable_peer_passes():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        me = cluster.Cluster(("127.0.0.1:1", f"127.0.0.1:{server.getsockname()[1]}"), 0)
        cluster.wait_for_peers(me, timeout=5)


def _ended(*codes) -> worker_processes.Workers:
    """Workers running each `python -c` code, every one ended before the launcher polls."""
    workers = worker_processes.Workers(
        [[sys.executable, "-c", code] for code in codes], [dict(os.environ)] * len(codes),
        [f"h:{i}" for i in range(len(codes))], io.StringIO())
    for process in workers.processes:
        process.wait()
    return workers


def test_a_worker_killed_by_a_signal_is_blamed_before_the_peers_it_took_down():
    """Worker 2 killed by SIGKILL and worker 0 exiting with the lost-peers code 3 end before
    the launcher polls: worker 2 is the failure named, whatever their order by index; a
    worker that exited with another error comes before a lost peer's exit."""
    lost_peers, killed = "import sys; sys.exit(3)", (
        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    workers = _ended(lost_peers, "import sys; sys.exit(0)", killed)
    assert workers.first_failure() == (2, -signal.SIGKILL)
    assert workers.blame(*workers.first_failure()) == "worker 2 was killed by signal SIGKILL"
    assert _ended(lost_peers, "import sys; sys.exit(1)").first_failure() == (1, 1)


def test_launcher_says_how_a_worker_ended():
    assert launch.how_it_ended(3) == "exited with code 3"
    assert launch.how_it_ended(-signal.SIGKILL) == "was killed by signal SIGKILL"
    spec = json.loads(launch.tf_config(["h:1", "h:2"], 1))
    assert cluster.from_environment({"TF_CONFIG": json.dumps(spec)}) == cluster.Cluster(
        ("h:1", "h:2"), 1)


@pytest.mark.parametrize("overrides,pattern", [
    (dict(global_batch_size=12), r"^--global_batch_size=12 does not split into 8 equal tower "
                                 r"shards \(--devices=cpu:4 on each of 2 workers\)"),
    # 2 workers x 2 devices x K = 3 towers each: 12 towers, before anything is built
    (dict(devices="cpu:2", towers_per_device=3, global_batch_size=16),
     r"^--global_batch_size=16 does not split into 12 equal tower shards \(--devices=cpu:2 x "
     r"--towers_per_device=3 on each of 2 workers\); use a multiple of 12$"),
    # each worker vectorizes its towers; a method inside the node would run on shared devices
    (dict(devices="cpu:2", towers_per_device=2, aggregation="topk:ratio=0.1",
          within_node="ring"), r"^--towers_per_device=2: --within_node=ring runs a method"),
    (dict(aggregation="colocate"), r"^--aggregation=colocate across 2 workers"),
    (dict(aggregation="independent"), r"^--aggregation=independent across 2 workers"),
    (dict(batch_norm="sync"), r"^--batch_norm=sync across 2 workers"),
    (dict(collective_timeout=0), r"^--collective_timeout=0 is out of range"),
    (dict(collective_timeout=2.0), r"^--collective_timeout=2.0 is out of range: must be >= 5.0"),
])
def test_what_several_workers_cannot_do_is_refused(overrides, pattern, monkeypatch, tmp_path):
    from tests import helpers
    monkeypatch.setenv("TF_CONFIG", launch.tf_config(["127.0.0.1:1", "127.0.0.1:2"], 0))
    settings = dict(devices="cpu:4", global_batch_size=16)
    settings.update(overrides)
    with pytest.raises(ConfigError, match=pattern):
        helpers.small_config(str(tmp_path / "run"), **settings).validated()


def test_a_port_in_use_is_refused_in_one_line_before_the_server_starts():
    with socket.socket() as holder:  # what already listens on the worker's port
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        me = cluster.Cluster((f"127.0.0.1:{port}", "127.0.0.1:1"), 0)
        with pytest.raises(ConfigError, match=rf"^TF_CONFIG: worker 0's own address "
                                              rf"127.0.0.1:{port}: cannot listen on port {port} "
                                              r"\(Address already in use\)") as error:
            cluster.start(me)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("host,pattern", [
    ("192.0.2.7", r"host 192.0.2.7 \(192.0.2.7\) is not an address of this machine"),
    ("no-such-host.invalid", r"host 'no-such-host.invalid' does not resolve"),
])
def test_a_host_that_is_not_this_machine_is_refused(host, pattern):
    """TensorFlow's server listens on every interface whatever TF_CONFIG says (README): a
    worker's own host must at least be one of this machine's addresses (192.0.2.7 is
    TEST-NET-1, never assigned)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConfigError, match=rf"^TF_CONFIG: worker 1's own address {host}:{port}: "
                                          + pattern):
        cluster.start(cluster.Cluster(("127.0.0.1:1", f"{host}:{port}"), 1))


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", socket.gethostname()])
def test_this_machines_own_free_address_passes(host):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cluster.check_own_address(cluster.Cluster((f"{host}:{port}", "127.0.0.1:1"), 0))


# A stand-in worker: reports its pid and a child's (same process group), then waits;
# SIGTERM and SIGINT only print (as a worker busy saving would stay).
STUB = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
for s in (signal.SIGTERM, signal.SIGINT):
    signal.signal(s, lambda n, f: print("got", signal.Signals(n).name, flush=True))
print("ready, child", child.pid, flush=True)
while True:
    time.sleep(0.1)
"""


def alive(pid, wait=10.0):
    """Whether `pid` still runs after up to `wait` s (a killed process takes a moment to go)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rpartition(")")[2].split()[0] == "Z":
                    return False
        except OSError:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.1)


def signal_when(out, patterns, signum, then=None):
    """From a thread: once every pattern is in `out`, sends `signum` to this process."""
    def run():
        if all(out.wait_for(p) for p in patterns):
            os.kill(os.getpid(), signum)
            if then:
                then()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_signal_to_the_launcher_reaches_every_worker_then_their_groups_are_killed():
    """SIGTERM is forwarded; workers still running after --stop_seconds are killed with
    their children; the launcher exits 128 + 15."""
    out = Lines()
    signal_when(out, [r"^\[worker 0\] ready", r"^\[worker 1\] ready"], signal.SIGTERM)
    code = launch.launch(2, "cpu:1", [], grace=60, stop_seconds=2, out=out,
                         command=[sys.executable, "-c", STUB])
    assert code == 128 + signal.SIGTERM
    assert "[worker 0] got SIGTERM" in out.text and "[worker 1] got SIGTERM" in out.text
    assert "[launch] worker(s) 0, 1 still running: killed" in out.text
    children = [int(c) for c in re.findall(r"ready, child (\d+)", out.text)]
    assert len(children) == 2
    for pid in out.pids() + children:
        assert not alive(pid), pid


def test_a_second_signal_kills_the_workers_at_once():
    out = Lines()
    returned, watchdog = threading.Event(), []

    def second_signal():
        if out.wait_for(r"^\[worker 0\] got SIGTERM") and out.wait_for(
                r"^\[worker 1\] got SIGTERM"):
            os.kill(os.getpid(), signal.SIGINT)
        if not returned.wait(120):  # the launcher should have returned long before
            watchdog.append(True)
            for pid in out.pids():
                os.killpg(pid, signal.SIGKILL)

    signal_when(out, [r"^\[worker 0\] ready", r"^\[worker 1\] ready"], signal.SIGTERM,
                then=second_signal)
    code = launch.launch(2, "cpu:1", [], grace=60, stop_seconds=600, out=out,
                         command=[sys.executable, "-c", STUB])
    returned.set()
    assert not watchdog, "the second signal did not stop the workers"
    assert code == 128 + signal.SIGTERM  # the first signal's
    assert "got SIGINT" not in out.text  # the second is not forwarded: the groups are killed
    for pid in out.pids():
        assert not alive(pid), pid


# Worker 1 stops itself (SIGSTOP) after writing its pid; worker 0 waits until it is stopped,
# then ends as mgloop.train does when its health checks give up on worker 1.
FROZEN = """
import json, os, signal, sys, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
folder, lost_message = sys.argv[-2:]
flag = os.path.join(folder, "frozen")
if index == 1:
    with open(flag + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(flag + ".tmp", flag)
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)
while not os.path.exists(flag):
    time.sleep(0.1)
pid = open(flag).read()
while open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] != "T":
    time.sleep(0.1)
print("mgloop.train: error: lost the other workers (" + lost_message + "); ...",
      file=sys.stderr)
sys.exit(3)
"""


def test_the_launcher_names_the_frozen_worker_not_the_survivor(tmp_path):
    from mgloop.cluster import peer_health
    lost = peer_health.lost_peer_message(1, "127.0.0.1:1", 30)  # the words the launcher reads
    out = Lines()
    code = launch.launch(2, "cpu:1", [str(tmp_path), lost], grace=600, out=out,
                         command=[sys.executable, "-c", FROZEN])
    assert code == 3
    assert re.search(r"^\[launch\] worker 1 stopped answering \(process stopped, by SIGSTOP\?\); "
                     r"worker 0 exited with code 3 after its health checks of worker 1 failed",
                     out.text, re.M), out.text
    for pid in out.pids():  # the stopped worker was killed at once, not after 600 s
        assert not alive(pid), pid


# Worker 1 writes its pid and waits; worker 0 kills it and exits with mgloop.train's lost-peer
# code at once: both end between two of the launcher's polls (0.2 s apart; a poll landing in
# the microseconds between them reports the same line by the other path).
KILLED_THEN_LOST = """
import json, os, signal, sys, time
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
flag = os.path.join(sys.argv[-1], "pid")
if index == 1:
    with open(flag + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(flag + ".tmp", flag)
    time.sleep(600)
while not os.path.exists(flag):
    time.sleep(0.05)
os.kill(int(open(flag).read()), signal.SIGKILL)
os._exit(3)
"""


def test_workers_ending_between_two_polls_are_still_blamed(tmp_path):
    out = Lines()
    code = launch.launch(2, "cpu:1", [str(tmp_path)], grace=600, out=out,
                         command=[sys.executable, "-c", KILLED_THEN_LOST])
    assert code == 128 + signal.SIGKILL  # the killed worker's, not the survivor's 3
    assert re.search(r"^\[launch\] worker 1 was killed by signal SIGKILL", out.text, re.M), \
        out.text


class _Checks:
    """Stands in for TensorFlow's context in the health checks: answers worker 1's checks
    as `answers` says, one per check (then its last again), and records the abort."""

    def __init__(self, answers):
        import tensorflow as tf
        self.answers, self.checks, self.aborted = list(answers), 0, threading.Event()
        self.errors = {"ok": None,
                       "refused": tf.errors.UnavailableError(None, None, (
                           "failed to connect to all addresses; last error: UNKNOWN: "
                           "ipv4:127.0.0.1:2: Failed to connect to remote host: Connection "
                           "refused")),
                       "deadline": tf.errors.DeadlineExceededError(None, None,
                                                                   "Deadline Exceeded")}

    def check_collective_ops_peer_health(self, task, timeout_in_ms):
        assert task.endswith("task:1")
        answer = self.answers[min(self.checks, len(self.answers) - 1)]
        self.checks += 1
        if self.errors[answer] is not None:
            raise self.errors[answer]

    def abort_collective_ops(self, code, message):
        self.aborted.set()


@pytest.mark.parametrize("answers, gone", [
    (["ok", "ok", "refused"], True),  # ended: its server refuses
    (["ok", "refused", "ok", "refused", "ok", "refused", "ok"], False),  # never twice in a row
    (["ok", "deadline"], False),  # stopped or cut off: only the timeout declares it
])
def test_a_peer_whose_server_refuses_twice_is_gone_long_before_the_timeout(
        monkeypatch, answers, gone):
    from tensorflow.python.eager import context
    from mgloop.cluster import peer_health
    checks = _Checks(answers)
    monkeypatch.setattr(context, "context", lambda: checks)
    monkeypatch.setattr(peer_health, "RECHECK", 0.02)
    health = peer_health.PeerHealth(cluster.Cluster(("127.0.0.1:1", "127.0.0.1:2"), 0),
                                    timeout=600)
    health.interval = 0.02  # (600 s would check every 5 s)
    with health:
        if gone:
            assert checks.aborted.wait(timeout=30), checks.checks
        else:  # every scripted answer and two more checks, then still not declared
            deadline = time.monotonic() + 30
            while checks.checks < len(answers) + 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not checks.aborted.is_set(), checks.checks
    if gone:
        assert health.lost == peer_health.gone_peer_message(1, "127.0.0.1:2", 2)
        assert peer_health.find_lost_peer(f"lost ({health.lost})")[0] == 1  # launch reads it
        assert checks.checks == len(answers) + 1
    else:
        assert health.lost is None and checks.checks >= len(answers)


# A real worker 0 (TensorFlow's gRPC server, collective ops) whose worker 1's port has
# nothing listening: its health checks see gRPC's own refusal, with a 600 s timeout.
GONE_PEER = """
import sys, time
from mgloop.runs import quiet_start
quiet_start.load_tensorflow()
from mgloop.cluster import peer_health, workers
me = workers.Cluster(tuple(sys.argv[1:3]), 0)
workers.start(me)
health = peer_health.PeerHealth(me, timeout=600)
health.interval = 0.2  # (600 s would check every 5 s)
with health:
    deadline = time.monotonic() + 60
    while health.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
print(health.lost)
"""


def test_a_peer_whose_port_is_closed_is_gone_by_grpcs_own_refusals():
    ports = []
    for _ in range(2):
        with socket.socket() as sock:  # free ports: the first for worker 0, then closed
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    addresses = [f"127.0.0.1:{port}" for port in ports]
    done = subprocess.run([sys.executable, "-c", GONE_PEER, *addresses], capture_output=True,
                          text=True, timeout=300)
    from mgloop.cluster import peer_health
    assert done.stdout.strip() == peer_health.gone_peer_message(1, addresses[1], 2), (
        done.stdout + done.stderr[-3000:])


@pytest.mark.parametrize("nodes, tasks_per_node, rank, expected", [
    ("n[1-2]", "1(x2)", 1, (("n1:8888", "n2:8888"), 1)),
    ("gpu7", "2", 0, (("gpu7:8888", "gpu7:8889"), 0)),
    ("a,b", "2,1", 2, (("a:8888", "a:8889", "b:8888"), 2)),
])
def test_a_slurm_job_step_is_a_cluster(monkeypatch, nodes, tasks_per_node, rank, expected):
    """Without TF_CONFIG, srun's variables give the workers through TensorFlow's own
    SlurmClusterResolver; its rank is the worker index."""
    monkeypatch.delenv("TF_CONFIG", raising=False)
    total = sum(int(part.split("(")[0]) * (int(part.split("x")[1][:-1]) if "(x" in part else 1)
                for part in tasks_per_node.split(","))
    for name, value in dict(SLURM_STEP_NODELIST=nodes, SLURM_STEP_TASKS_PER_NODE=tasks_per_node,
                            SLURM_STEP_NUM_TASKS=str(total), SLURM_PROCID=str(rank)).items():
        monkeypatch.setenv(name, value)
    assert cluster.from_environment() == cluster.Cluster(*expected)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "1")
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert cluster.from_environment() is None  # one task: one process


def test_free_ports_lie_outside_the_kernels_ephemeral_range_and_bind(monkeypatch, tmp_path):
    """The launcher's ports are free, distinct, and never in the range the kernel hands to
    clients (a suite's other jobs' gRPC channels took a worker's port there, between its
    choice and the worker's listen); a port held by another socket is passed over."""
    import random
    from mgloop.cluster import worker_processes
    low, high = worker_processes._ephemeral()
    ports = worker_processes.free_ports(8)
    assert len(set(ports)) == 8
    assert all(worker_processes.LOWEST_PORT <= p < low or high < p <= 65535 for p in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free indeed
    with socket.socket() as held:  # the first port a seeded draw would pick, taken
        first = worker_processes.free_ports(1, random.Random(7))[0]
        held.bind(("127.0.0.1", first))
        assert first not in worker_processes.free_ports(3, random.Random(7))
    narrow = tmp_path / "range"
    narrow.write_text("10000\t65535\n")  # no port outside the range: refused in one line
    monkeypatch.setattr(worker_processes, "EPHEMERAL_RANGE", str(narrow))
    with pytest.raises(OSError, match="outside the ephemeral range 10000-65535"):
        worker_processes.free_ports(1)
