"""--ordered_sum_bytes side by side: step time and the host allocator's peak per step.

    python experiments/bench_ordered_sum.py --model=big_mlp --thresholds=0,16777216

One shared-layout mode on the same model, devices and global batch, built once
per threshold in this one process (0: the unordered sum) and timed with
interleaved repeats (experiments/benchlib.py). Per threshold: median
examples/sec with its median absolute deviation, the step-time ratio to the
first threshold, and the step's memory: after the timed loops, one more loop of
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
flags.DEFINE_string("devices", "cpu:4", "the same devices for every threshold")
flags.DEFINE_string("aggregation", "ps_cpu", "a shared-layout mode (ps_cpu, ps_device, ps_spread)")
flags.DEFINE_list("thresholds", ["0", str(16 * 2 ** 20)],
                  "--ordered_sum_bytes values; the first is the ratios' baseline")
flags.DEFINE_integer("global_batch_size", 512, "global batch, the same for every threshold")
flags.DEFINE_integer("steps", 2, "steps per timed loop")
flags.DEFINE_integer("warmup", 1, "untimed loops per threshold before timing")
flags.DEFINE_integer("repeats", 5, "timed loops per threshold, interleaved")
flags.DEFINE_string("json_out", None, "also write the results here as JSON")


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
    devices.configure_logical_cpus(devices.parse(_FLAGS.devices).num_towers)
    dataset = data.load(_FLAGS.dataset, 0)
    thresholds = [int(t) for t in _FLAGS.thresholds]
    built = {threshold: benchlib.build(_FLAGS.model, _FLAGS.global_batch_size,
                                       dataset_object=dataset, dataset=_FLAGS.dataset,
                                       devices=_FLAGS.devices, aggregation=_FLAGS.aggregation,
                                       optimizer="momentum", learning_rate=0.01,
                                       ordered_sum_bytes=threshold)
             for threshold in thresholds}
    times = benchlib.interleaved(built, _FLAGS.steps, _FLAGS.warmup, _FLAGS.repeats)
    base, _ = benchlib.median_and_mad(times[thresholds[0]])
    rows = []
    for threshold in thresholds:
        trainer, iterator = built[threshold]
        order = trainer._ordered_sum()
        rows.append({
            "ordered_sum_bytes": threshold,
            "ordered_variables": len(order.indices) if order else 0,
            **benchlib.speed(times[threshold], _FLAGS.global_batch_size, base),
            "loop_peak_mib": loop_peak_mib(trainer, iterator, _FLAGS.steps),
            "step_ms_repeats": [1e3 * t for t in times[threshold]]})
    benchlib.report(
        f"model {_FLAGS.model}, {_FLAGS.aggregation} on {_FLAGS.devices}, global batch "
        f"{_FLAGS.global_batch_size}, {_FLAGS.steps} steps/loop, {_FLAGS.repeats} interleaved "
        f"repeats; command: python {' '.join(sys.argv)}", rows, [
            ("ordered_sum_bytes", "--ordered_sum_bytes", "d"),
            ("ordered_variables", "variables summed in order", "d"),
            ("examples_per_sec", "examples/sec (median)", ".0f"),
            ("mad_examples_per_sec", "± MAD", ".0f"), ("step_ms", "step (ms)", ".1f"),
            ("ratio", "step-time ratio", ".2f"),
            ("loop_peak_mib", "allocator peak above start (MiB)", ".0f")], _FLAGS.json_out)

if __name__ == "__main__":
    app.run(main)
