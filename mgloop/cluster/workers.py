"""Several processes: the cluster described by TF_CONFIG (or a Slurm job step), on
TensorFlow's own runtime.

TF_CONFIG is the JSON that MultiWorkerMirroredStrategy reads:

    {"cluster": {"worker": ["host0:2222", "host1:2222"]},
     "task": {"type": "worker", "index": 1}}

Worker 0 is the chief. Each worker starts TensorFlow's in-process gRPC server
for its own address with collective ops enabled (`start`), after which its
devices are named `/job:worker/replica:0/task:<index>/device:...`, and
`CollectiveReduceV2` ops whose group spans the workers run over gRPC.

TensorFlow's server listens on every interface of the machine (`0.0.0.0:<port>`,
hard-coded in its GrpcServer::Init; no ServerDef, ConfigProto field or
environment variable changes the host), not only on the host named in
TF_CONFIG, and it authenticates no one: whoever reaches the port can take part
in the job's collectives. So the ports must be on a private network
(docs/multi-worker.md), and `start` first checks, one ConfigError line each, that this
worker's TF_CONFIG host is an address of this machine (`check_own_address`)
and that its port is free.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time

from mgloop.errors import ConfigError

JOB = "worker"
_started: "Cluster | None" = None  # the cluster this process serves (`start`), once


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
        """`/job:worker/replica:0/task:<index>` (this worker's by default)."""
        return f"/job:{JOB}/replica:0/task:{self.index if index is None else index}"


def from_environment(environ=None) -> Cluster | None:
    """The cluster of TF_CONFIG; else, inside a Slurm job step of several tasks (`srun`),
    the one TensorFlow's SlurmClusterResolver gives (`from_slurm`); else None (a single
    process). `environ` (tests): a mapping read instead of the process's TF_CONFIG.

    Raises ConfigError with one line for a TF_CONFIG mgloop cannot use.
    """
    raw = (os.environ if environ is None else environ).get("TF_CONFIG", "").strip()
    if not raw:
        return from_slurm() if environ is None else None
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


def from_slurm() -> Cluster | None:
    """Inside a Slurm job step (SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE,
    SLURM_STEP_NUM_TASKS, SLURM_PROCID set by srun) of more than one task: the workers
    as TensorFlow's SlurmClusterResolver lays them out (hosts sorted by name, a node's
    tasks on consecutive ports from $MGLOOP_PORT_BASE, default 8888, the resolver's),
    this task's index its rank. Devices are left to --devices (no CUDA_VISIBLE_DEVICES
    is set). None outside Slurm or for a one-task step."""
    if "SLURM_STEP_NODELIST" not in os.environ or "SLURM_PROCID" not in os.environ:
        return None
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as slurm
    try:
        tasks = int(os.environ["SLURM_STEP_NUM_TASKS"])
        if tasks <= 1:
            return None
        per_node = max(slurm.expand_tasks_per_node(os.environ["SLURM_STEP_TASKS_PER_NODE"]))
        port = int(os.environ.get("MGLOOP_PORT_BASE", "8888"))
        resolver = slurm.SlurmClusterResolver(
            jobs={JOB: tasks}, port_base=port, gpus_per_node=per_node, gpus_per_task=1,
            auto_set_gpu=False)
        workers = tuple(resolver.cluster_spec().as_dict()[JOB])
        _, index = resolver.get_task_info()
    except (KeyError, ValueError, RuntimeError) as error:
        raise ConfigError(f"the Slurm job step's environment is not usable ({type(error).__name__}:"
                          f" {error}); run the workers with srun, or set TF_CONFIG") from None
    return Cluster(workers, int(index))


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


def check_own_address(cluster: Cluster) -> None:
    """Refuses, in one ConfigError line, an own TF_CONFIG address this process cannot serve:
    a host that does not resolve or is not an address of this machine (checked by binding
    a socket to it), a port outside 1..65535, or a port that cannot be listened on
    (in use), probed as TensorFlow will bind it: on every interface."""
    address = cluster.workers[cluster.index]
    host, port = _split_address(address)
    where = f"TF_CONFIG: worker {cluster.index}'s own address {address}"
    if not 1 <= port <= 65535:
        raise ConfigError(f"{where}: port {port} is out of range 1..65535")
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as error:
        raise ConfigError(f"{where}: host {host!r} does not resolve "
                          f"({getattr(error, 'strerror', None) or error}); give a host name "
                          "that resolves here, or its IP address") from None
    resolved = sorted({sockaddr[0] for *_, sockaddr in found})
    if not any(_binds(family, sockaddr[0], 0) for family, *_, sockaddr in found):
        raise ConfigError(
            f"{where}: host {host} ({', '.join(resolved)}) is not an address of this machine "
            f"({socket.gethostname()}); task.index must point at this machine's own entry")
    problem = _binds(socket.AF_INET, "0.0.0.0", port, reason=True)
    if problem is not True:
        raise ConfigError(f"{where}: cannot listen on port {port} ({problem}); stop what "
                          "holds it or give this worker another port")


def _binds(family: int, host: str, port: int, reason: bool = False):
    """Whether a TCP socket binds to (host, port) here (with reason: True or why not)."""
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
        try:
            probe.bind((host, port))
            return True
        except OSError as error:
            return (error.strerror or str(error)) if reason else False


def start(cluster: Cluster) -> None:
    """Starts this worker's gRPC server with collective ops enabled.

    Call once per process, after configuring logical devices and before any
    other TensorFlow work. This is what MultiWorkerMirroredStrategy does on
    creation; mgloop does it directly because it runs its own loop. Refuses an
    address this process cannot serve first (`check_own_address`).
    """
    global _started
    if _started is not None:
        if _started != cluster:
            raise ConfigError(f"this process already serves worker {_started.index} of "
                              f"{_started.workers}; TF_CONFIG now names worker {cluster.index} "
                              f"of {cluster.workers}: one process is one worker")
        return  # a second run in the same worker process (e.g. a sweep): already serving
    check_own_address(cluster)
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.core.protobuf import tensorflow_server_pb2
    from tensorflow.python.eager import context

    session = config_pb2.ConfigProto()
    session.CopyFrom(context.context().config)  # keeps the logical device configuration
    session.experimental.collective_group_leader = cluster.task(0)
    cluster_spec = tf.train.ClusterSpec({JOB: list(cluster.workers)})
    server_def = tensorflow_server_pb2.ServerDef(
        cluster=cluster_spec.as_cluster_def(), default_session_config=session, job_name=JOB,
        task_index=cluster.index, protocol="grpc")
    context.context().enable_collective_ops(server_def)
    context.context().ensure_initialized()  # the server listens from here on
    _started = cluster
