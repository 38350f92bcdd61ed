"""Large gradients side by side: --ordered_sum_bytes and --sufficient_factor_bytes.

    python experiments/bench_large_gradients.py --model=big_mlp \
        --variants=0:0,16777216:0,16777216:16777216 --one_device

One shared-layout mode on the same model, devices and global batch, built once
per variant in this one process and timed with interleaved repeats
(experiments/benchlib.py). A variant is `ORDERED:FACTORED`, the values of
--ordered_sum_bytes and --sufficient_factor_bytes (0: off; `0:0` is the plain
sum, the tower-by-tower gradients summed by one AddN). With --one_device the
same mode on one logical device (`cpu:1`, same global batch) runs beside them:
the tower tax's baseline. Per row: median examples/sec with its median absolute
deviation, the step-time ratio to the first row (and, with --one_device, to
the one device's step: the tower tax), the variables the traced step ordered
and factored, and the step's memory: after the timed loops, one more loop of
`steps` steps runs with the host allocator's peak reset before it
(tf.config.experimental.get_memory_info on TensorFlow's BFC allocator, which
devices.configure_logical_cpus turns on), and the figure is that peak minus the
bytes held when it started: what the steps allocate beyond the variables,
slots and staged input every system holds. Whole-process peak RSS, with one
process per system, is experiments/bench.py's.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402

import benchlib  # noqa: E402

_FLAGS = flags.FLAGS
flags.DEFINE_string("model", "big_mlp", "model to measure")
flags.DEFINE_string("dataset", "random_binary", "dataset of the model")
flags.DEFINE_string("devices", "cpu:4", "the same devices for every variant")
flags.DEFINE_string("aggregation", "ps_cpu", "a shared-layout mode (ps_cpu, ps_device, ps_spread)")
flags.DEFINE_list("variants", ["0:0", "16777216:0", "16777216:16777216"],
                  "ORDERED:FACTORED pairs of --ordered_sum_bytes and --sufficient_factor_bytes; "
                  "the first is the ratios' baseline")
flags.DEFINE_bool("one_device", False, "also the same mode on cpu:1 (the tower tax's baseline)")
flags.DEFINE_integer("global_batch_size", 512, "global batch, the same for every variant")
benchlib.define_timing_flags("variant", steps=2, warmup=1, repeats=5)

ONE_DEVICE = "cpu:1"


def parse_variant(text: str) -> tuple[int, int]:
    ordered, _, factored = text.partition(":")
    try:
        return int(ordered), int(factored)
    except ValueError:
        raise app.UsageError(f"--variants: {text!r} is not ORDERED:FACTORED (two byte counts, "
                             "e.g. 16777216:0)") from None


def loop_peak_mib(trainer, iterator, steps: int) -> float:
    """MiB the host allocator holds at the peak of one loop beyond what it held before."""
    import tensorflow as tf
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    trainer.train_loop(iterator, steps)
    return (tf.config.experimental.get_memory_info("CPU:0")["peak"] - before) / 2 ** 20


def main(argv):
    del argv
    from mgloop import data, devices
    variants = {text: parse_variant(text) for text in _FLAGS.variants}
    devices.configure_logical_cpus(devices.parse(_FLAGS.devices).num_towers)
    dataset = data.load(_FLAGS.dataset, 0)

    def build(device_flag, ordered, factored):
        return benchlib.build(_FLAGS.model, _FLAGS.global_batch_size, dataset_object=dataset,
                              dataset=_FLAGS.dataset, devices=device_flag,
                              aggregation=_FLAGS.aggregation, optimizer="momentum",
                              learning_rate=0.01, ordered_sum_bytes=ordered,
                              sufficient_factor_bytes=factored)

    built = {text: build(_FLAGS.devices, *pair) for text, pair in variants.items()}
    if _FLAGS.one_device:
        built[ONE_DEVICE] = build(ONE_DEVICE, 0, 0)
    times = benchlib.interleaved(built, _FLAGS.steps, _FLAGS.warmup, _FLAGS.repeats)
    base, _ = benchlib.median_and_mad(times[_FLAGS.variants[0]])
    one = benchlib.median_and_mad(times[ONE_DEVICE])[0] if _FLAGS.one_device else None
    rows = []
    for name, (trainer, iterator) in built.items():
        ordered, factored = (0, 0) if name == ONE_DEVICE else variants[name]
        rows.append({
            "system": (f"{_FLAGS.aggregation} on {ONE_DEVICE}" if name == ONE_DEVICE else
                       f"{_FLAGS.aggregation} on {_FLAGS.devices}, {name}"),
            "ordered_sum_bytes": ordered, "sufficient_factor_bytes": factored,
            # as the traced step did: the large kernels of plain products are factored,
            # the ordered sum takes the other large variables
            "factored": len(trainer.large_gradients["factored"]),
            "ordered": len(trainer.large_gradients["ordered"]),
            **benchlib.speed(times[name], _FLAGS.global_batch_size, base),
            "tower_tax": benchlib.median_and_mad(times[name])[0] / one if one else None,
            "loop_peak_mib": loop_peak_mib(trainer, iterator, _FLAGS.steps),
            "step_ms_repeats": [1e3 * t for t in times[name]]})
    benchlib.report(
        f"model {_FLAGS.model}, global batch {_FLAGS.global_batch_size}, {_FLAGS.steps} "
        f"steps/loop, {_FLAGS.repeats} interleaved repeats; command: python "
        f"{' '.join(sys.argv)}", rows, [
            ("system", "system, ORDERED:FACTORED", "s"),
            ("factored", "variables factored", "d"),
            ("ordered", "variables summed in order", "d"),
            ("examples_per_sec", "examples/sec (median)", ".0f"),
            ("mad_examples_per_sec", "± MAD", ".0f"), ("step_ms", "step (ms)", ".1f"),
            ("ratio", "step-time ratio", ".2f"), ("tower_tax", "step ÷ cpu:1's", ".2f"),
            ("loop_peak_mib", "allocator peak above start (MiB)", ".0f")], _FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
