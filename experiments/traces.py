"""What a traced step holds and does: overlap of the exchange, op time per type, op count.

    python -m experiments.traces overlap --vary aggregation=ring,ps_cpu \
        --vary pack_bytes=0,4000000 --set model=mlp --set devices=cpu:4 --steps=5
    python -m experiments.traces overlap --trace_dir=<logdir>/plugins/profile
    python -m experiments.traces ops <trace dir> [--top=15] [--steps=N]
    python -m experiments.traces count ring cpu:4 [setting=value ...]

`overlap`: does the gradient exchange run while the towers' backward passes still
compute? DDP and Horovod start exchanging the gradients of the last layers while the
backward pass still computes the first layers' (their main speed lever). Here, per
profiled training step, from the tf.profiler trace (the XSpace protobuf, read with
mgloop.observe.breakdown): the exchange E is the union of the intervals of the ops built
in the `aggregation` phase's name scope (packing, the method's reduce, the sums at
home), the backward pass B the union of the ops in the `compute` phase built by the
gradient tape (a `gradient_tape` or `gradients` name-scope segment) on every tower.
Reported:

    overlap   |E ∩ B| / |E|: the share of the exchange's busy time during which
              some backward op of some tower runs at once
    early     |E before the end of B| / |E|: the share of the exchange's busy time
              before the last backward op ended (what could overlap, whatever the
              executor's threads did at that moment)
    starts    when the first exchange op starts, as a fraction of B's span (0: with
              the first gradient; 1: after the last backward op)
    E, B      their busy milliseconds under the profiler (which slows every op: compare
              fractions, not these with unprofiled step times)

A fraction near 0 means the exchange waits for every gradient (e.g. one bucket of all of
them: its concatenation needs the last gradient the backward pass makes, which is the
first layer's). Each variant (mgloop/runs/sweep/grid.py: `--vary`, `--set`, `--plugin`
as in experiments/variants.py) is built in this process, warmed up, and `--steps` steps
are profiled one at a time (one loop of one step per profiler session), so every trace
holds one step; the table gives the median over the steps and the range. With
`--trace_dir` the trace files found under it are read instead, each as one window (for
per-step figures, trace one step: `--profile_steps=A,A+1` of mgloop.train).
`--bucket_order=backward` forms the --pack_bytes buckets from the last variable back (an
experiment: mgloop's packing.plan goes in variable order).

`ops`: where the time of a traced loop goes, op time per op type. Reads the
`*.xplane.pb` files that `tf.profiler.experimental.start/stop` wrote (e.g. bench.py
--profile; the same trace TensorBoard's Profile tab shows, with the
tensorboard-plugin-profile package: `pip install -e '.[profile]'`). Sums the durations of
the host's TensorFlow op events (the "TensorFlow Ops" lines of the /host:CPU plane) by op
type (the event name's last component before the ":Type" suffix), and reports each
type's total milliseconds per step (`--steps`: the steps of the traced loop), event count
and share of the summed op time. The runtime's own spans are listed in [brackets]:
`[ExecutorState::Process]` is the executor running a batch of ready ops (it encloses the
kernels it runs), `[...ProcessAsync::Start]` and `[...::Done]` are asynchronous ops (the
_Recv of a cross-device edge), so op events and spans overlap. Ops run concurrently on
the inter-op threads, so shares are of busy time, not of wall time.

`count`: ops in the traced compiled loop (every function of its graph) of the tests' small
config (tests/helpers.py; built by mgloop/runs/prepare.py) with aggregation MODE on
DEVICES and any Config settings: a deterministic check that a refactor of the step adds
no per-step work. Run it on two checkouts and compare.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import sys
import tempfile

from absl import app, flags
import numpy as np

from experiments import benchlib

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The entry's flags (defined only when it runs: the tests import this module)."""
    flags.DEFINE_integer("steps", None, "overlap: steps profiled per variant, one per trace "
                         "(default 5); ops: training steps in the traced loop, for per-step "
                         "figures (default 1)")
    flags.DEFINE_multi_string("vary", [], "overlap: KEY=V1,V2,... as in experiments/variants.py")
    flags.DEFINE_multi_string("set", [], "overlap: KEY=VALUE as in experiments/variants.py")
    flags.DEFINE_multi_string("plugin", [], "overlap: a module to import first; repeatable")
    flags.DEFINE_integer("warmup", 2, "overlap: untimed loops of --warmup_steps steps per "
                         "variant first")
    flags.DEFINE_integer("warmup_steps", 5, "overlap: steps per warm-up loop")
    flags.DEFINE_string("trace_dir", None, "overlap: read the traces under this folder instead "
                        "of building and profiling variants")
    flags.DEFINE_string("json_out", None, "overlap: also write the results here as JSON")
    flags.DEFINE_enum("bucket_order", "forward", ["forward", "backward"],
                      "overlap: --pack_bytes buckets formed in variable order (mgloop's "
                      "packing.plan) or, as an experiment, in reverse order (the order "
                      "backprop makes the gradients)")
    flags.DEFINE_integer("top", 15, "ops: op types to list")
    flags.DEFINE_multi_string("method", [], "first_step: a method's spec (NAME or "
                              "NAME:key=value,...); repeatable; default: every method")
    flags.DEFINE_multi_enum("setup", list(SETUPS), list(SETUPS), "first_step: the setups")
    flags.DEFINE_float("timeout", 300, "first_step: seconds a cell's process may run")


# --- overlap: the figures of one trace (times in the trace are picoseconds) ---------------

_BACKWARD = re.compile(r"(gradient_tape|gradients)(_\d+)?")


def merged(intervals) -> list[tuple[int, int]]:
    """The union of [start, end) intervals as disjoint sorted intervals."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals) -> int:
    return sum(end - start for start, end in intervals)


def intersection(a, b) -> int:
    """Length of the intersection of two disjoint sorted interval lists."""
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, high - low)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def is_backward(name: str) -> bool:
    return any(_BACKWARD.fullmatch(segment) for segment in name.split("/"))


def overlap_of(space) -> dict:
    """The figures of one trace (see the top of this module), in milliseconds and fractions."""
    from mgloop.observe import breakdown
    exchange, backward = [], []
    for name, start, end in breakdown.op_intervals(space):
        phase = breakdown.phase_of(name)
        if phase == "aggregation":
            exchange.append((start, end))
        elif phase == "compute" and is_backward(name):
            backward.append((start, end))
    if not exchange or not backward:
        raise ValueError(f"the trace has {len(exchange)} exchange and {len(backward)} backward "
                         "ops: nothing to compare")
    exchange, backward = merged(exchange), merged(backward)
    busy = length(exchange)
    before_end = intersection(exchange, [(exchange[0][0], backward[-1][1])])
    return {"exchange_ms": busy * 1e-9, "backward_ms": length(backward) * 1e-9,
            "overlap": intersection(exchange, backward) / busy, "early": before_end / busy,
            "starts": (exchange[0][0] - backward[0][0]) / (backward[-1][1] - backward[0][0])}


# --- overlap: profiling variants ----------------------------------------------------------

def profiled_steps(trainer, iterator, steps: int) -> list[dict]:
    import shutil
    import tensorflow as tf
    from mgloop.observe import breakdown
    out = []
    for _ in range(steps):
        folder = tempfile.mkdtemp(prefix="mgloop-overlap-")
        try:
            tf.profiler.experimental.start(folder, options=breakdown.PROFILER_OPTIONS)
            try:
                trainer.train_loop(iterator, 1)
            finally:
                tf.profiler.experimental.stop()
            out.append(overlap_of(breakdown.read_trace(folder)))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return out


def summarise(name: str, steps: list[dict]) -> dict:
    row = {"variant": name, "steps": steps}
    for key in ("overlap", "early", "starts", "exchange_ms", "backward_ms"):
        values = [s[key] for s in steps]
        row[key] = float(np.median(values))
        row[f"{key}_range"] = (float(min(values)), float(max(values)))
    return row


def use_backward_buckets() -> None:
    """Experiment only: mgloop's packing.plan applied to the variables in reverse order, so
    that the first bucket holds the last layers' gradients, which backprop makes first
    (PyTorch DDP's bucket order). pack/unpack follow any plan's index lists unchanged."""
    from mgloop.aggregation.kernels import packing
    forward = packing.plan

    def plan(values, bucket_bytes):
        order = list(reversed(range(len(values))))
        buckets = forward([values[i] for i in order], bucket_bytes)
        return [[order[i] for i in bucket] for bucket in buckets]
    packing.plan = plan


def measure_variants() -> list[dict]:
    from mgloop.cluster import devices
    from mgloop.runs.config import Config
    from mgloop.runs.sweep import grid
    chosen = [(v, Config(**{"train_steps": 10 ** 9, "logdir": os.path.join(
        tempfile.gettempdir(), "mgloop-overlap"), **v.settings}).validated())
        for v in grid.variants(FLAGS.vary, FLAGS.set)]
    devices.configure_logical_cpus(max(config.num_towers for _, config in chosen))
    if FLAGS.bucket_order == "backward":
        use_backward_buckets()
    rows, datasets = [], {}
    for variant, config in chosen:  # one at a time: a trainer is dropped after its steps
        key = (config.dataset, config.seed, config.data_dir)
        trainer, iterator, datasets[key] = benchlib.build_config(config, datasets.get(key))
        for _ in range(FLAGS.warmup):
            trainer.train_loop(iterator, FLAGS.warmup_steps)
        rows.append(summarise(variant.name, profiled_steps(trainer, iterator, FLAGS.steps)))
        trainer.release_input()
        del trainer, iterator
    return rows


def read_spaces(folder: str) -> list[tuple[str, object]]:
    """(path relative to `folder`, XSpace) of every *.xplane.pb under it."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as handle:
            space.ParseFromString(handle.read())
        out.append((os.path.relpath(path, folder), space))
    if not out:
        raise SystemExit(f"traces.py: error: no *.xplane.pb under {folder}")
    return out


def overlap_markdown(rows: list[dict]) -> str:
    def span(row, key, pattern):
        low, high = row[f"{key}_range"]
        return f"{pattern.format(row[key])} ({pattern.format(low)}–{pattern.format(high)})"
    lines = ["| variant | overlap \\|E∩B\\|/\\|E\\| | early (E before B ends) | E starts "
             "(share of B's span) | exchange E (ms) | backward B (ms) |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['variant']} | {span(row, 'overlap', '{:.2f}')} | "
                     f"{span(row, 'early', '{:.2f}')} | {span(row, 'starts', '{:.2f}')} | "
                     f"{row['exchange_ms']:.2f} | "
                     f"{row['backward_ms']:.2f} |")
    return "\n".join(lines)


def overlap(args) -> None:
    if args:
        raise app.UsageError(f"unexpected arguments: {' '.join(args)}")
    from mgloop.errors import ConfigError
    from mgloop.runs.sweep import grid
    try:
        benchlib.load_plugins(FLAGS.plugin)
        rows = ([summarise(name, [overlap_of(space)])
                 for name, space in read_spaces(FLAGS.trace_dir)] if FLAGS.trace_dir
                else measure_variants())
    except (ConfigError, grid.SpecError, benchlib.PluginError) as error:
        print(f"traces.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    command = benchlib.command_line()
    print(f"command: {command}; load average {os.getloadavg()[0]:.1f}; median over "
          f"{FLAGS.steps} profiled steps (range)\n")
    print(overlap_markdown(rows))
    if FLAGS.json_out:
        benchlib.write_json(FLAGS.json_out, {
            "command": command, "machine": benchlib.machine(), "rows": rows,
            "settings": {name: getattr(FLAGS, name) for name in (
                "vary", "set", "plugin", "steps", "warmup", "warmup_steps", "trace_dir",
                "bucket_order")}})


# --- ops ----------------------------------------------------------------------------------

def op_times(trace_dir: str) -> tuple[dict[str, float], dict[str, int], float]:
    """(milliseconds per op type, events per op type, wall milliseconds spanned)."""
    totals, counts = collections.Counter(), collections.Counter()
    first, last = None, None
    for _, space in read_spaces(trace_dir):
        for plane in space.planes:
            if not plane.name.startswith("/host:CPU"):
                continue
            names = {key: meta.name for key, meta in plane.event_metadata.items()}
            for line in plane.lines:
                if line.name == "python" or line.name.startswith("tf_data"):
                    continue  # the Python caller, the input pipeline
                for event in line.events:
                    name = names.get(event.metadata_id, "?")
                    if "::" in name:  # the runtime's own spans, e.g. ExecutorState::Process
                        op_type = f"[{name}]"
                    elif ":" in name:  # an op: "<op name>:<op type>"
                        op_type = name.rsplit(":", 1)[1]
                    else:
                        continue  # thread-pool bookkeeping
                    totals[op_type] += event.duration_ps / 1e9
                    counts[op_type] += 1
                    start = line.timestamp_ns + event.offset_ps / 1e3
                    end = start + event.duration_ps / 1e3
                    first = start if first is None else min(first, start)
                    last = end if last is None else max(last, end)
    span = (last - first) / 1e6 if first is not None else 0.0
    return dict(totals), dict(counts), span


def ops(args) -> None:
    if len(args) != 1:
        raise app.UsageError("usage: traces.py ops <trace dir> [--top=N] [--steps=N]")
    totals, counts, span = op_times(args[0])
    busy = sum(ms for op_type, ms in totals.items() if not op_type.startswith("["))
    steps = FLAGS.steps
    events = sum(n for op_type, n in counts.items() if not op_type.startswith("["))
    print(f"command: {benchlib.command_line()}")
    print(f"{args[0]}: per step {events / steps:.0f} op events, {busy / steps:.3f} ms of op time "
          f"summed over threads, {span / steps:.3f} ms from first op to last "
          f"({busy / events * 1e3:.1f} us per op event)")
    print("| op type | ms per step | events per step | share of op time |\n|---|---|---|---|")
    print("(runtime spans in [brackets] enclose op time; their share is relative to it)")
    for op_type, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:FLAGS.top]:
        print(f"| {op_type} | {ms / steps:.3f} | {counts[op_type] / steps:.0f} | {ms / busy:.1%} |")


# --- count --------------------------------------------------------------------------------

COUNT_BATCH = 16  # the global batch of the tests' small config (tests/helpers.py)


def count(args) -> None:
    if len(args) < 2:
        raise app.UsageError("usage: traces.py count MODE DEVICES [setting=value ...]")
    from mgloop import data
    from mgloop.runs import prepare
    from mgloop.runs.config import Config
    mode, devices = args[0], args[1]
    extra = {k: (int(v) if v.isdigit() else v) for k, v in (a.split("=", 1) for a in args[2:])}
    settings = dict(devices=devices, aggregation=mode, model="mlp", diagnostics=False,
                    global_batch_size=COUNT_BATCH, optimizer="momentum", learning_rate=0.1,
                    train_steps=5, steps_per_loop=5, seed=3, deterministic=True,
                    logdir=os.path.join(tempfile.gettempdir(), f"count_step_ops_{mode}"),
                    summary_every=0, log_every=0)
    dataset = data.synthetic.make(seed=7, num_train=256, num_eval=64)
    trainer = prepare.trainer_for(Config(**dict(settings, **extra)), dataset)
    batches = [(x.numpy(), y.numpy())
               for x, y in dataset.train_batches(extra.get("global_batch_size", COUNT_BATCH),
                                                 3).take(2)]
    prepare.train_on(trainer, batches)
    loop = trainer.loop.compiled_loop
    total = 0
    for function in loop._list_all_concrete_functions():
        graph = function.graph.as_graph_def()
        total += len(graph.node) + sum(len(f.node_def) for f in graph.library.function)
    print(f"ops {mode} {devices} {extra}: {total}")


# --- first_step: the seconds and peak memory of the call that traces ----------------------

# The setups of `first_step`: mgloop.train's flags besides --aggregation (each cell one run)
SETUPS = {
    # 4 simulated nodes of one tower each, the method between them
    "nodes4_lm": ["--nodes=4", "--devices=cpu:4", "--model=transformer_lm",
                  "--dataset=python_text"],
    # 64 towers computed as one vectorized batch on one device, the method sees them all
    "towers64_mlp": ["--devices=cpu:1", "--towers_per_device=64", "--global_batch_size=1024",
                     "--model=mlp", "--dataset=digits"],
}


def first_step_cell(method: str, setup: str, timeout: float, extra=()) -> dict:
    """One run of mgloop.train in a child process of its own, ended once its first step has
    run (the rest, the final evaluation included, would only add time): the seconds of its
    first step (the log line of mgloop/runs/tracing_log.py, the figure summary.json calls
    `traced_step_seconds`: trace and first run), the child's seconds until then, and its
    peak RSS until then (its own rusage, from wait4)."""
    import re
    import signal
    import subprocess
    import time
    logdir = tempfile.mkdtemp(prefix="first_step_")
    command = [sys.executable, "-m", "mgloop.train", f"--aggregation={method}", *SETUPS[setup], *extra,
               "--train_steps=2", "--steps_per_loop=2", "--summary_every=0", "--log_every=0",
               f"--logdir={logdir}"]
    row = {"setup": setup, "method": method, "status": "ok", "trace_s": None, "wall_s": None,
           "peak_rss_gb": None}
    traced = re.compile(r"traced the training step and ran it once in ([0-9.]+) s")
    log = os.path.join(logdir, "stderr.txt")
    began = time.perf_counter()
    with open(log, "w") as err:
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err,
                                 cwd=os.path.dirname(HERE))
    while True:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid:  # ended before its first step was logged: refused or failed
            child.returncode = os.waitstatus_to_exitcode(status)
            with open(log) as handle:
                lines = [line.strip() for line in handle if line.strip()]
            refused = [line.split("error: ", 1)[1] for line in lines if "error: " in line]
            errors = [line for line in lines if "Error" in line or line.startswith("E1")]
            row["status"] = ("refused: " + refused[-1][:160] if refused else
                             "failed: " + (errors or lines or ["?"])[-1][-160:])
            break
        with open(log) as handle:
            found = traced.search(handle.read())
        if found or time.perf_counter() - began > timeout:
            child.send_signal(signal.SIGKILL)
            _, status, usage = os.wait4(child.pid, 0)
            child.returncode = -9
            if found:
                row["trace_s"] = float(found.group(1))
            else:
                row["status"] = f"timeout {timeout:.0f} s"
            break
        time.sleep(0.5)
    row["wall_s"] = time.perf_counter() - began
    row["peak_rss_gb"] = usage.ru_maxrss * 1024 / 1e9  # ru_maxrss: KiB on Linux
    return row


def first_step(args) -> None:
    """Every method (or --method) in every --setup, the cells in that order (give the
    slowest first), each a fresh `python -m mgloop.train` run with a --timeout."""
    from mgloop import aggregation
    methods = FLAGS.method or aggregation.names()
    rows = []
    for setup in FLAGS.setup:
        for method in methods:
            row = first_step_cell(method, setup, FLAGS.timeout)
            if "use --optimizer=sgd" in row["status"]:  # a method with its own momentum
                row = first_step_cell(method, setup, FLAGS.timeout, ["--optimizer=sgd"])
                row["method"] = f"{method} (--optimizer=sgd)"
            rows.append(row)
            print(f"{setup} {method}: {row['status']}, trace {row['trace_s']} s, "
                  f"peak {row['peak_rss_gb']:.2f} GB", file=sys.stderr, flush=True)
            if FLAGS.json_out:  # as it goes: a long invocation cut short keeps its rows
                benchlib.write_json(FLAGS.json_out, {"command": benchlib.command_line(),
                                                     "rows": rows})
    benchlib.publish("first step (trace + first run) per method and setup", rows,
                     [("setup", "setup", ""), ("method", "method", ""),
                      ("trace_s", "trace + first step (s)", ".1f"),
                      ("peak_rss_gb", "peak RSS (GB)", ".2f"),
                      ("wall_s", "process until then (s)", ".0f"), ("status", "status", "")],
                     FLAGS.json_out, {"setups": {name: SETUPS[name] for name in FLAGS.setup},
                                      "timeout": FLAGS.timeout})


COMMANDS = {"overlap": (overlap, {"steps": 5}), "ops": (ops, {"steps": 1}),
            "count": (count, {}), "first_step": (first_step, {})}


if __name__ == "__main__":
    define_flags()
    app.run(lambda argv: benchlib.dispatch(argv, COMMANDS))
