"""TF_CONFIG parsing, peer checks and the launcher's reporting (no second process needed)."""

import json
import signal
import socket
import time

import pytest

from mgloop import cluster, launch
from mgloop.errors import ConfigError


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


def test_launcher_says_how_a_worker_ended():
    assert launch.how_it_ended(3) == "exited with code 3"
    assert launch.how_it_ended(-signal.SIGKILL) == "was killed by signal SIGKILL"
    spec = json.loads(launch.tf_config(["h:1", "h:2"], 1))
    assert cluster.from_environment({"TF_CONFIG": json.dumps(spec)}) == cluster.Cluster(
        ("h:1", "h:2"), 1)


@pytest.mark.parametrize("overrides,pattern", [
    (dict(global_batch_size=12), r"^--global_batch_size=12 does not split into 8 equal tower "
                                 r"shards \(--devices=cpu:4 on each of 2 workers\)"),
    (dict(aggregation="colocate"), r"^--aggregation=colocate across 2 workers"),
    (dict(aggregation="independent"), r"^--aggregation=independent across 2 workers"),
    (dict(batch_norm="sync"), r"^--batch_norm=sync across 2 workers"),
    (dict(mixed_precision="mixed_float16"), r"^--mixed_precision=mixed_float16 across 2 workers"),
    (dict(collective_timeout=0), r"^--collective_timeout=0 is out of range"),
])
def test_what_several_workers_cannot_do_is_refused(overrides, pattern, monkeypatch, tmp_path):
    from tests import helpers
    monkeypatch.setenv("TF_CONFIG", launch.tf_config(["127.0.0.1:1", "127.0.0.1:2"], 0))
    settings = dict(devices="cpu:4", global_batch_size=16)
    settings.update(overrides)
    with pytest.raises(ConfigError, match=pattern):
        helpers.small_config(str(tmp_path / "run"), **settings).validated()
