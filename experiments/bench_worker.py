"""One benchmark system in its own process, driven line by line over stdin/stdout.

    python -m experiments.bench_worker      (started by experiments/bench.py)

Protocol (one JSON object per line; replies are prefixed by `@@bench ` so that
anything else a library prints to stdout is ignored):

    in:  {"spec": {...bench_systems.Spec fields...}, "logical_devices": N}
    out: {"ready": true, "build_seconds": s, "baseline_rss_kib": r, "devices": [...]}
    in:  "first_step"          out: {"loss": l, "loss_terms": n, "batch_statistics": b}
                                   one step before any loop (l: the initial weights' loss on
                                   the first batch; n, b: bench_systems.loss_terms and
                                   batch_statistics of its model)
    in:  "run"                 out: {"seconds": s, "loss": l}   one timed loop
    in:  {"trace": DIR}        out: {"seconds": s, "loss": l}   one loop under tf.profiler
                                                   (worker i of several: into DIR/worker<i>)
    in:  {"save_weights": DIR} out: {"path": P}   the model's weights to DIR/weights-<i>.npz
    in:  "stop"                out: {"peak_rss_kib": p}         then exits

`loss` is the mean over the loop's steps of the step's loss over the global
batch; `devices` the devices the system computes on in this process; <i> in
the weights file is the worker's TF_CONFIG index (0 without TF_CONFIG).
A multi-worker system's processes (TF_CONFIG set) start their gRPC server
first (bench_systems.start), before anything else touches TensorFlow; then the
spec's `plugins` are imported (a method one registers can be the system).

Memory: `baseline_rss_kib` is the resident set after TensorFlow started with
its devices and the dataset was loaded, before the system was built;
`peak_rss_kib` is the process's peak resident set (getrusage ru_maxrss,
KiB on Linux) at the end, which covers building, tracing and every loop.
One process per system, so each peak is that system's alone. `optimizer_bytes`
(mgloop's systems): the largest optimizer state one device holds (Replicas.optimizer_bytes).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

PREFIX = "@@bench "


def reply(payload: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(payload) + "\n")
    sys.stdout.flush()


def peak_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main() -> None:
    request = json.loads(sys.stdin.readline())
    from mgloop.runs import quiet_start
    quiet_start.load_tensorflow()  # as mgloop.train loads it (its lines: TF_CPP_MIN_LOG_LEVEL)
    from mgloop import data
    from mgloop.cluster import devices
    devices.configure_logical_cpus(request["logical_devices"])
    from experiments import bench_systems
    spec = bench_systems.Spec(**request["spec"])
    runtime = bench_systems.start(spec)
    from experiments import benchlib
    benchlib.load_plugins(spec.plugins)  # e.g. a module registering an aggregation method
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"] if spec.workers > 1 else None
    import numpy as np
    import tensorflow as tf
    from mgloop.observe.diagnostics import current_rss_kib
    dataset = data.load(spec.dataset, spec.seed)
    dataset._train_tensors  # the host copy every system reads, made before the baseline
    baseline = current_rss_kib()
    began = time.perf_counter()
    system = bench_systems.build(spec, dataset, runtime)
    reply({"ready": True, "build_seconds": time.perf_counter() - began,
           "baseline_rss_kib": baseline, "devices": list(system.devices)})
    for line in sys.stdin:
        command = json.loads(line)
        if command == "first_step":
            reply({"loss": system.first_step(),
                   "loss_terms": bench_systems.loss_terms(system.model, dataset,
                                                          spec.global_batch),
                   "batch_statistics": bench_systems.batch_statistics(system.model)})
        elif command == "run":
            reply({"seconds": system.run(), "loss": system.last_loss})
        elif isinstance(command, dict) and "trace" in command:
            tf.profiler.experimental.start(
                command["trace"] if task is None else os.path.join(command["trace"],
                                                                   f"worker{task}"))
            seconds = system.run()
            tf.profiler.experimental.stop()
            reply({"seconds": seconds, "loss": system.last_loss})
        elif isinstance(command, dict) and "save_weights" in command:
            path = os.path.join(command["save_weights"], f"weights-{task or 0}.npz")
            with open(path + ".tmp", "wb") as handle:
                np.savez(handle, *[np.asarray(w) for w in system.model.get_weights()])
            os.replace(path + ".tmp", path)
            reply({"path": path})
        elif command == "stop":
            system.close()
            counted = getattr(getattr(system, "owner", None), "aggregation", None)
            traffic = None if counted is None else {  # mgloop's counts (the link model)
                "bytes": counted.traffic.as_dict(),
                "messages": counted.traffic.messages_as_dict()}
            replicas = getattr(getattr(system, "owner", None), "replicas", None)
            reply({"peak_rss_kib": peak_rss_kib(), "traffic": traffic,
                   # mgloop's: the largest optimizer state any of its devices holds
                   "optimizer_bytes": None if replicas is None else max(
                       replicas.optimizer_bytes()["state"].values())})
            return


if __name__ == "__main__":
    try:
        main()
    except BaseException as error:  # noqa: BLE001 (reported to the harness, which stops)
        reply({"error": f"{type(error).__name__}: {error}",
               "traceback": traceback.format_exc()[-4000:]})
        sys.exit(1)
