"""Every aggregation mode side by side: speed, exchange time and bytes per device.

    python experiments/bench_aggregation.py --model=mlp --devices=cpu:4

All modes run on the same model, devices and global batch, built in this one
process and timed with interleaved repeats (experiments/benchlib.py). Per
mode: median examples/sec after warm-up with its median absolute deviation,
the step-time ratio to the first mode, the measured time of the gradient
exchange alone (Trainer.time_exchange), and the bytes each device sends and
receives per step (counted from the algorithm while the step is traced).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402

import benchlib  # noqa: E402

ALL_CPU_MODES = ["ps_cpu", "ps_device", "ps_spread", "reduce_broadcast", "ring", "hierarchical",
                 "collective", "colocate", "independent"]

_FLAGS = flags.FLAGS
flags.DEFINE_string("model", "mlp", "model to measure")
flags.DEFINE_string("devices", "cpu:4", "the same devices for every mode")
flags.DEFINE_list("modes", ALL_CPU_MODES, "aggregation modes; the first is the ratios' baseline")
flags.DEFINE_integer("pack_bytes", 0, "--pack_bytes for every mode that exchanges gradients")
flags.DEFINE_integer("global_batch_size", 128, "global batch, the same for every mode")
benchlib.define_timing_flags("mode", steps=50, warmup=2, repeats=9)


def main(argv):
    del argv
    from mgloop import aggregation, devices
    devices.configure_logical_cpus(devices.parse(_FLAGS.devices).num_towers)
    built = {}
    for mode in _FLAGS.modes:
        pack = _FLAGS.pack_bytes if aggregation.get(mode).exchanges and mode != "ps_spread" else 0
        built[mode] = benchlib.build(_FLAGS.model, _FLAGS.global_batch_size,
                                     devices=_FLAGS.devices, aggregation=mode, pack_bytes=pack)
    times = benchlib.interleaved(built, _FLAGS.steps, _FLAGS.warmup, _FLAGS.repeats)
    base, _ = benchlib.median_and_mad(times[_FLAGS.modes[0]])
    rows = []
    for mode in _FLAGS.modes:
        trainer = built[mode][0]
        traffic = trainer.aggregation.traffic.as_dict()
        exchange = trainer.time_exchange(repeats=_FLAGS.repeats)
        rows.append({
            "mode": mode, **benchlib.speed(times[mode], _FLAGS.global_batch_size, base),
            "exchange_ms": None if exchange is None else 1e3 * exchange,
            "max_sent_kib": max((c["sent"] for c in traffic.values()), default=0) / 1024,
            "max_received_kib": max((c["received"] for c in traffic.values()), default=0) / 1024,
            "traffic": traffic})
    benchlib.report(
        f"model {_FLAGS.model}, devices {_FLAGS.devices}, global batch "
        f"{_FLAGS.global_batch_size}, {_FLAGS.steps} steps/loop, {_FLAGS.repeats} interleaved "
        f"repeats; command: python {' '.join(sys.argv)}", rows, [
            ("mode", "mode", "s"), ("examples_per_sec", "examples/sec (median)", ".0f"),
            ("mad_examples_per_sec", "± MAD", ".0f"), ("ratio", "step-time ratio", ".2f"),
            ("exchange_ms", "exchange alone (ms)", ".3f"),
            ("max_sent_kib", "max sent/device/step (KiB)", ".1f"),
            ("max_received_kib", "max received/device/step (KiB)", ".1f")], _FLAGS.json_out)

if __name__ == "__main__":
    app.run(main)
