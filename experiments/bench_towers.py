"""Tower tax: step time of N towers against 1 device on the same global batch, side by side.

    python experiments/bench_towers.py --models=mlp,cnn --systems=cpu:1/ring,cpu:4/ring

Every system (a `devices/aggregation` pair) is built in this one process and
timed with interleaved repeats (experiments/benchlib.py). Reported: median
seconds per step, its median absolute deviation, examples/sec, and the ratio
of each system's median step time to the first system's.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402

import benchlib  # noqa: E402

_FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mlp"], "models to measure")
flags.DEFINE_list("systems", ["cpu:1/ring", "cpu:4/ring"],
                  "devices/aggregation pairs; the first is the baseline of the ratios")
flags.DEFINE_integer("global_batch_size", 128, "global batch, the same for every system")
benchlib.define_timing_flags("system", steps=50, warmup=2, repeats=9)


def measure(model: str, systems: list[str]) -> list[dict]:
    built = {}
    for system in systems:
        device_spec, aggregation = system.split("/")
        built[system] = benchlib.build(model, _FLAGS.global_batch_size, devices=device_spec,
                                       aggregation=aggregation)
    times = benchlib.interleaved(built, _FLAGS.steps, _FLAGS.warmup, _FLAGS.repeats)
    base, _ = benchlib.median_and_mad(times[systems[0]])
    rows = []
    for system in systems:
        median, mad = benchlib.median_and_mad(times[system])
        rows.append({"model": model, "system": system, "median_ms": 1e3 * median,
                     "mad_ms": 1e3 * mad, "examples_per_sec": _FLAGS.global_batch_size / median,
                     "ratio": median / base})
    return rows


def main(argv):
    del argv
    from mgloop import devices
    devices.configure_logical_cpus(
        max(devices.parse(s.split("/")[0]).num_towers for s in _FLAGS.systems))
    rows = [row for model in _FLAGS.models for row in measure(model, _FLAGS.systems)]
    benchlib.report(
        f"global batch {_FLAGS.global_batch_size}, {_FLAGS.steps} steps/loop, "
        f"{_FLAGS.repeats} interleaved repeats; command: python {' '.join(sys.argv)}", rows, [
            ("model", "model", "s"), ("system", "system", "s"),
            ("median_ms", "median step (ms)", ".3f"), ("mad_ms", "MAD (ms)", ".3f"),
            ("examples_per_sec", "examples/sec", ".0f"), ("ratio", "step-time ratio", ".2f")],
        _FLAGS.json_out)

if __name__ == "__main__":
    app.run(main)
