"""Does the gradient exchange run while the towers' backward passes still compute? From traces.

    python experiments/overlap.py --vary aggregation=ring,ps_cpu --vary pack_bytes=0,4000000 \
        --set model=mlp --set devices=cpu:4 --steps=5
    python experiments/overlap.py --trace_dir=<logdir>/plugins/profile   (an existing trace)

DDP and Horovod start exchanging the gradients of the last layers while the
backward pass still computes the first layers' (their main speed lever). Here,
per profiled training step, from the tf.profiler trace (the XSpace protobuf,
read with mgloop.observe.breakdown): the exchange E is the union of the intervals of
the ops built in the `aggregation` phase's name scope (loop.Trainer: packing,
the method's reduce, the sums at home), the backward pass B the union of the
ops in the `compute` phase built by the gradient tape (a `gradient_tape` or
`gradients` name-scope segment) on every tower. Reported:

    overlap   |E ∩ B| / |E|: the share of the exchange's busy time during which
              some backward op of some tower runs at once
    early     |E before the end of B| / |E|: the share of the exchange's busy time
              before the last backward op ended (what could overlap, whatever the
              executor's threads did at that moment)
    starts    when the first exchange op starts, as a fraction of B's span (0: with
              the first gradient; 1: after the last backward op)
    E, B      their busy milliseconds under the profiler (which slows every op: compare
              fractions, not these with unprofiled step times)

A fraction near 0 means the exchange waits for every gradient (e.g. one bucket
of all of them: its concatenation needs the last gradient the backward pass
makes, which is the first layer's). Each variant (mgloop/runs/sweep/grid.py:
`--vary`, `--set`, `--plugin` as in variants.py) is built in this process,
warmed up, and `--steps` steps are profiled one at a time (one loop of one
step per profiler session), so every trace holds one step; the table gives the
median over the steps and the range. With `--trace_dir` the trace files found
under it are read instead, each as one window (for per-step figures, trace one
step: `--profile_steps=A,A+1` of mgloop.train). `--bucket_order=backward` forms
the --pack_bytes buckets from the last variable back (an experiment: mgloop's
packing.plan goes in variable order).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

import benchlib  # noqa: E402
from overlap_trace import overlap_of  # noqa: E402
from mgloop.runs.sweep import grid as variants_spec  # noqa: E402

_FLAGS = flags.FLAGS
flags.DEFINE_multi_string("vary", [], "KEY=V1,V2,... as in experiments/variants.py")
flags.DEFINE_multi_string("set", [], "KEY=VALUE as in experiments/variants.py")
flags.DEFINE_multi_string("plugin", [], "a module to import first; repeatable")
flags.DEFINE_integer("steps", 5, "steps profiled per variant, one per trace")
flags.DEFINE_integer("warmup", 2, "untimed loops of --warmup_steps steps per variant first")
flags.DEFINE_integer("warmup_steps", 5, "steps per warm-up loop")
flags.DEFINE_string("trace_dir", None, "read the traces under this folder instead of "
                    "building and profiling variants")
flags.DEFINE_string("json_out", None, "also write the results here as JSON")
flags.DEFINE_enum("bucket_order", "forward", ["forward", "backward"],
                  "--pack_bytes buckets formed in variable order (mgloop's packing.plan) or, as "
                  "an experiment, in reverse order (the order backprop makes the gradients)")

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
    from mgloop.aggregation import packing
    forward = packing.plan

    def plan(values, bucket_bytes):
        order = list(reversed(range(len(values))))
        buckets = forward([values[i] for i in order], bucket_bytes)
        return [[order[i] for i in bucket] for bucket in buckets]
    packing.plan = plan


def measure_variants() -> list[dict]:
    from mgloop.cluster import devices
    from mgloop.runs.config import Config
    chosen = [(v, Config(**{"train_steps": 10 ** 9, "logdir": os.path.join(
        tempfile.gettempdir(), "mgloop-overlap"), **v.settings}).validated())
        for v in variants_spec.variants(_FLAGS.vary, _FLAGS.set)]
    devices.configure_logical_cpus(max(config.num_towers for _, config in chosen))
    if _FLAGS.bucket_order == "backward":
        use_backward_buckets()
    rows, datasets = [], {}
    for variant, config in chosen:  # one at a time: a trainer is dropped after its steps
        key = (config.dataset, config.seed, config.data_dir)
        trainer, iterator, datasets[key] = benchlib.build_config(config, datasets.get(key))
        for _ in range(_FLAGS.warmup):
            trainer.train_loop(iterator, _FLAGS.warmup_steps)
        rows.append(summarise(variant.name, profiled_steps(trainer, iterator, _FLAGS.steps)))
        trainer.release_input()
        del trainer, iterator
    return rows


def measure_traces(folder: str) -> list[dict]:
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)):
        space = xplane_pb2.XSpace()
        with open(path, "rb") as handle:
            space.ParseFromString(handle.read())
        rows.append(summarise(os.path.relpath(path, folder), [overlap_of(space)]))
    if not rows:
        raise SystemExit(f"overlap.py: error: no *.xplane.pb under {folder}")
    return rows


def markdown(rows: list[dict]) -> str:
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


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from mgloop.errors import ConfigError
    try:
        benchlib.load_plugins(_FLAGS.plugin)
        rows = (measure_traces(_FLAGS.trace_dir) if _FLAGS.trace_dir
                else measure_variants())
    except (ConfigError, variants_spec.SpecError, benchlib.PluginError) as error:
        print(f"overlap.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    print(f"Command: `python {' '.join(sys.argv)}`; load average "
          f"{os.getloadavg()[0]:.1f}; median over {_FLAGS.steps} profiled steps (range)\n")
    print(markdown(rows))
    if _FLAGS.json_out:
        with open(_FLAGS.json_out, "w") as handle:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    app.run(main)
