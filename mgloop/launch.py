"""`python -m mgloop.launch --num_workers=N [--devices_per_worker=cpu:2] -- <train flags>`.

Starts N local `mgloop.train` worker processes on free loopback ports, each with
its own TF_CONFIG and in its own process group, and streams their output line by
line with a `[worker i]` prefix. The train flags after `--` reach every worker as
given, `--plugin=MODULE` included: each worker imports the module (from the
launcher's working directory and Python path) before it validates its settings.

When a worker fails, the launcher names the worker at fault: the one that ended,
or, when a survivor ended with exit code 3 naming a peer its health checks gave up on
(mgloop/cluster/peer_health.py), that peer, adding whether its process is stopped
(SIGSTOP); workers that all ended between two polls are blamed alike. The others
then stop by themselves (their collectives fail, or their health checks find the
ended peer's server gone, or give up on a silent one after --collective_timeout) or
are terminated after --grace_seconds; a stopped worker is killed at once. The
launcher exits with the first failure's code.

SIGTERM, SIGINT or SIGHUP to the launcher is forwarded to every worker (SIGHUP as
SIGTERM), which may then save a checkpoint and exit; workers still running after
--stop_seconds, or at a second signal, are killed with their process groups. The
launcher then exits with 128 + the signal's number (143 for SIGTERM, 130 for
SIGINT), as a shell reports a process ended by it.

`--elastic --min_workers=M --max_restarts=R --rejoin_seconds=S`: a failed worker does not
end the job; the others continue from the last complete checkpoint and the failed slot
rejoins later (mgloop/cluster/elastic.py).

`--netns` (root): each worker runs in a network namespace of its own, on a link shaped to the
train flags' `--link=between:BANDWIDTH,LATENCY` (mgloop/cluster/netns.py); TF_CONFIG names
the namespaces' addresses, and the namespaces are removed whatever ends the job.

The launcher's flags are made from the fields of cluster/launch_options.py (`LaunchOptions`,
the rules of `mgloop.train`'s: runs/flags.py) and read back into one; cluster/launch_checks.py
refuses a value out of range.

For a real cluster, set TF_CONFIG on each host and run `python -m mgloop.train` there
(docs/multi-worker.md).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from absl import app
from absl import flags

from mgloop import errors  # imports no TensorFlow
from mgloop.cluster import elastic as elastic_lib  # imports no TensorFlow
from mgloop.cluster import launch_checks  # imports no TensorFlow
from mgloop.cluster import netns as netns_lib  # imports no TensorFlow
from mgloop.cluster import worker_processes  # imports no TensorFlow
from mgloop.cluster.worker_processes import FORWARDED, free_ports, how_it_ended, is_stopped
from mgloop.cluster.launch_options import ELASTIC_ONLY, LaunchOptions
from mgloop.cluster.worker_processes import tf_config
from mgloop.data import options as data_options  # imports no TensorFlow
from mgloop.errors import ConfigError
from mgloop.observe import link_model  # imports no TensorFlow
from mgloop.runs import flags as mgloop_flags  # imports no TensorFlow

_FLAGS = flags.FLAGS
mgloop_flags.define_flags_of(LaunchOptions, __name__)  # the launcher's own, before `--`

_POLL_SECONDS = 0.2
__all__ = ["free_ports", "how_it_ended", "launch", "tf_config"]


def launch(num_workers: int, devices: str, train_flags: list[str], grace: float,
           stop_seconds: float = 60.0, out=sys.stdout, command: list[str] | None = None,
           elastic: elastic_lib.ElasticOptions | None = None,
           netns: netns_lib.Shaping | None = None) -> int:
    """Runs the workers to the end; returns 0, the first failure's exit code, or 128 + the
    number of the signal that stopped the launcher. `command` replaces
    `python -m mgloop.train` (tests). `elastic`: rounds that restart from failures
    (cluster/elastic.py). `netns`: the workers in namespaces on links shaped so
    (cluster/netns.py; 1 if they cannot be made), removed before this returns."""
    command = command or [sys.executable, "-m", "mgloop.train"]
    received: list[int] = []
    current: list = [None]  # the running round's Workers
    network: list = [None]  # the run's netns_lib.Network

    def on_signal(signum, frame):
        received.append(signum)
        if current[0] is None:
            return
        if len(received) == 1:
            current[0].forward(FORWARDED[signum])
        else:
            current[0].kill(range(len(current[0].processes)))

    def start(count: int, env: dict | None = None) -> worker_processes.Workers:
        hosts = ([network[0].address(i) for i in range(count)] if network[0]
                 else ["127.0.0.1"] * count)
        addresses = [f"{host}:{port}" for host, port in zip(hosts, free_ports(count))]
        prefixes = [network[0].exec_prefix(i) if network[0] else [] for i in range(count)]
        workers = current[0] = worker_processes.Workers(
            [[*prefixes[i], *command, f"--devices={devices}", *train_flags]
             for i in range(count)],
            [dict(os.environ, **(env or {}), TF_CONFIG=tf_config(addresses, i))
             for i in range(count)],
            addresses, out)
        if received:  # a signal came while the workers were starting
            workers.forward(FORWARDED[received[0]])
        return workers

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, on_signal) for s in FORWARDED}
    try:
        if netns is not None:
            try:
                network[0] = netns_lib.Network.create(
                    num_workers, netns, lambda text: worker_processes.say(out, text))
            except netns_lib.NetnsError as error:
                worker_processes.say(out, f"error: {error}")
                return 1
            if received:  # a signal came while the namespaces were made
                return 128 + received[0]
        if elastic is not None:
            return elastic_lib.run(
                start, num_workers, elastic, received, stop_seconds,
                lambda text: current[0].say(text) if current[0] else worker_processes.say(out, text), current)
        return _supervise(start(num_workers), received, grace, stop_seconds)
    finally:
        if current[0] is not None:
            current[0].finish()
            current[0] = None  # a signal during the removal below finds no workers to signal
        if network[0] is not None:
            network[0].remove()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _supervise(workers: worker_processes.Workers, received: list[int], grace: float,
               stop_seconds: float) -> int:
    """Watches the workers until every one has ended (see the module docstring)."""
    phase, deadline, failed = "running", None, None
    while workers.running():
        now = time.monotonic()
        if received and phase != "stopping":
            signum = received[0]
            workers.say(f"received {signal.Signals(signum).name}: sent "
                        f"{signal.Signals(FORWARDED[signum]).name} to every worker; waiting up "
                        f"to {stop_seconds:.0f}s for them to save and exit (a second signal "
                        "kills them)")
            phase, deadline = "stopping", now + stop_seconds
        elif phase == "running":
            failed = workers.first_failure()
            if failed is not None:
                workers.say(f"{workers.blame(*failed)}; waiting up to {grace:.0f}s for the "
                            "others to stop")
                phase, deadline = "failed", now + grace
        if phase != "running":  # a stopped worker would never end by itself
            workers.kill([i for i in workers.running() if is_stopped(workers.processes[i].pid)])
        if deadline is not None and now >= deadline:
            left = ", ".join(map(str, workers.running()))
            if phase == "failed":
                workers.say(f"worker(s) {left} still running after {grace:.0f}s: terminated")
                for index in workers.running():
                    worker_processes.signal_group(workers.processes[index], signal.SIGTERM)
                phase, deadline = "terminating", now + 10.0
            else:
                workers.say(f"worker(s) {left} still running: killed")
                workers.kill(workers.running())
                break
        time.sleep(_POLL_SECONDS)
    if received:
        return 128 + received[0]
    if failed is None:
        failed = workers.first_failure()
        if failed is None:
            return 0
        # every worker ended between two polls: blamed all the same
        workers.say(f"{workers.blame(*failed)}; the other workers had ended")
    return failed[1] if failed[1] > 0 else 128 - failed[1]


def devices_refusal(train_flags: list[str]) -> str | None:
    """The one line that refuses --devices among the train flags (the launcher sets it per
    worker), or None."""
    if any(f.startswith("--devices=") or f == "--devices" for f in train_flags):
        return ("--devices is set per worker by the launcher: give --devices_per_worker="
                "DEVICES (e.g. cpu:2) instead of --devices after --")
    return None


def towers_per_worker(devices: str, train_flags: list[str]) -> int | None:
    """The towers of one worker from --devices_per_worker (cpu:N, gpu:I,J) and
    --towers_per_device, or None where the spec does not say (auto, gpu)."""
    kind, _, listed = devices.partition(":")
    if not listed:
        return None
    count = int(listed) if kind == "cpu" and listed.isdigit() else len(listed.split(","))
    per_device = elastic_lib.flag_value(train_flags, "towers_per_device")
    return count * (int(per_device) if per_device and per_device.isdigit() else 1)


def link_values(train_flags: list[str]) -> list[str]:
    """Every --link among the train flags as absl reads them (repeatable; --link VALUE and
    --flagfile too, up to a `--`). A flagfile that cannot be read raises flags.Error."""
    argv = flags.FlagValues().read_flags_from_files(list(train_flags))
    values, index = [], 0
    while index < len(argv) and argv[index] != "--":
        bare = argv[index].lstrip("-") if argv[index].startswith("-") else None
        if bare == "link" and index + 1 < len(argv):
            values.append(argv[index + 1])
            index += 1
        elif bare is not None and bare.startswith("link="):
            values.append(bare.split("=", 1)[1])
        index += 1
    return values


def netns_shaping(num_workers: int, train_flags: list[str]
                  ) -> tuple[netns_lib.Shaping | None, str | None]:
    """(the shaping of --netns, None) from the train flags' one --link=between:, or
    (None, the one line that refuses --netns here: settings or machine)."""
    try:
        between = [link for link in map(link_model.parse, link_values(train_flags))
                   if link.tier == "between"]
    except (ConfigError, flags.Error) as error:
        return None, str(error)
    if len(between) != 1:
        return None, (
            "--netns shapes the workers' links to the train flags' --link=between:BANDWIDTH,"
            f"LATENCY, given {len(between)} times: give it once after -- (with its "
            "--link=within:), e.g. -- --link=within:100gbit,2us --link=between:100mbit,50us")
    shaping = netns_lib.Shaping(between[0].bytes_per_second * 8, between[0].latency_seconds)
    return shaping, netns_lib.refusal(num_workers, shaping)


def main(argv):
    train_flags = argv[1:]
    options = mgloop_flags.options_from_flags(LaunchOptions)
    try:
        launch_checks.check(options, given=tuple(n for n in ELASTIC_ONLY if _FLAGS[n].present))
        problem = devices_refusal(train_flags)
    except ConfigError as error:
        problem = str(error)
    shaping = None
    if options.netns and problem is None:
        shaping, problem = netns_shaping(options.num_workers, train_flags)
    elastic = None
    if options.elastic and problem is None:
        try:  # --logdir as mgloop.train reads it: --logdir DIR, in a --flagfile too
            logdir = elastic_lib.flag_value(train_flags, "logdir")
            towers = towers_per_worker(options.devices_per_worker, train_flags)
        except flags.Error as error:  # a --flagfile that cannot be read
            problem = f"the train flags after -- cannot be read: {error}"
        else:
            elastic = elastic_lib.ElasticOptions(
                options.min_workers, options.max_restarts, options.rejoin_seconds, logdir or "")
            problem = elastic_lib.refusal(elastic, options.num_workers, train_flags, towers,
                                          data_options.DEFAULT_GLOBAL_BATCH_SIZE)
    if problem:  # one line and exit code 2, as mgloop.train's refusals (no usage text)
        print(f"mgloop.launch: error: {problem}", file=sys.stderr)
        sys.exit(2)
    sys.exit(launch(options.num_workers, options.devices_per_worker, train_flags,
                    options.grace_seconds, options.stop_seconds, elastic=elastic,
                    netns=shaping))


if __name__ == "__main__":
    app.run(main, flags_parser=errors.flags_parser("mgloop.launch"))
