"""Several processes: the cluster described by TF_CONFIG, on TensorFlow's own runtime.

TF_CONFIG is the JSON that MultiWorkerMirroredStrategy reads:

    {"cluster": {"worker": ["host0:2222", "host1:2222"]},
     "task": {"type": "worker", "index": 1}}

Worker 0 is the chief. Each worker starts TensorFlow's in-process gRPC server
for its own address with collective ops enabled (`start`), after which its
devices are named /job:worker/replica:0/task:<index>/device:..., and
`CollectiveReduceV2` ops whose group spans the workers run over gRPC.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time

from mgloop.errors import ConfigError

JOB = "worker"


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The workers' addresses (index order) and this process's index among them."""

    workers: tuple[str, ...]
    index: int

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def is_chief(self) -> bool:
        return self.index == 0

    def task(self, index: int | None = None) -> str:
        """'/job:worker/replica:0/task:<index>' (this worker's by default)."""
        return f"/job:{JOB}/replica:0/task:{self.index if index is None else index}"


def from_environment(environ=None) -> Cluster | None:
    """The cluster of TF_CONFIG, or None when it is unset (a single process).

    Raises ConfigError with one line for a TF_CONFIG mgloop cannot use.
    """
    raw = (os.environ if environ is None else environ).get("TF_CONFIG", "").strip()
    if not raw:
        return None
    try:
        spec = json.loads(raw)
        workers = spec["cluster"][JOB]
        task = spec["task"]
    except (ValueError, KeyError, TypeError) as error:
        raise ConfigError(
            f"TF_CONFIG is not usable ({type(error).__name__}: {error}); expected "
            '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", '
            '"index": i}}') from None
    others = sorted(set(spec["cluster"]) - {JOB})
    if others:
        raise ConfigError(f"TF_CONFIG has job(s) {', '.join(others)}; mgloop runs only "
                          "'worker' jobs (worker 0 is the chief)")
    if not isinstance(workers, list) or not workers or not all(
            isinstance(w, str) and _split_address(w) for w in workers):
        raise ConfigError(f"TF_CONFIG: cluster.worker must be a list of 'host:port', got "
                          f"{workers!r}")
    if task.get("type") != JOB or not isinstance(task.get("index"), int) or not (
            0 <= task["index"] < len(workers)):
        raise ConfigError(f"TF_CONFIG: task must be {{'type': 'worker', 'index': 0..."
                          f"{len(workers) - 1}}}, got {task!r}")
    return Cluster(tuple(workers), task["index"])


def _split_address(address: str) -> tuple[str, int] | None:
    host, _, port = address.rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


def wait_for_peers(cluster: Cluster, timeout: float) -> None:
    """Waits until every other worker's address accepts a connection.

    Raises ConfigError naming the first address still unreachable after
    `timeout` seconds, so a missing peer is a clear error, not a hang.
    """
    deadline = time.monotonic() + timeout
    for index, address in enumerate(cluster.workers):
        if index == cluster.index:
            continue
        host, port = _split_address(address)
        while True:
            try:
                with socket.create_connection((host, port), timeout=2.0):
                    break
            except OSError as error:
                if time.monotonic() >= deadline:
                    raise ConfigError(
                        f"TF_CONFIG: worker {index} at {address} is not reachable after "
                        f"{timeout:.0f}s ({error.strerror or error}); is it running?") from None
                time.sleep(0.5)


def start(cluster: Cluster) -> None:
    """Starts this worker's gRPC server with collective ops enabled.

    Call once per process, after configuring logical devices and before any
    other TensorFlow work. This is what MultiWorkerMirroredStrategy does on
    creation; mgloop does it directly because it runs its own loop.
    """
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.core.protobuf import tensorflow_server_pb2
    from tensorflow.python.eager import context

    config = config_pb2.ConfigProto()
    config.CopyFrom(context.context().config)  # keeps the logical device configuration
    config.experimental.collective_group_leader = cluster.task(0)
    cluster_spec = tf.train.ClusterSpec({JOB: list(cluster.workers)})
    server_def = tensorflow_server_pb2.ServerDef(
        cluster=cluster_spec.as_cluster_def(), default_session_config=config, job_name=JOB,
        task_index=cluster.index, protocol="grpc")
    context.context().enable_collective_ops(server_def)
    context.context().ensure_initialized()  # the server listens from here on
