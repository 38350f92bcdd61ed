"""What TensorFlow's all-reduce kernel costs by itself, against moving the same sum by hand.

    python -m experiments.collective_kernel --elements=42506 --towers=4

Three compiled loops of --steps steps on --towers logical CPU devices, each step starting
from one --elements float32 vector per device (a variable's value plus the step index):

    collective  CollectiveReduceV2 on every device (merge Add, final Div), the kernel
                behind mgloop's `collective` (ordered by a per-device token, as there)
    by_hand     the vectors sent to device 0, added, scaled and sent back to every device
                (mgloop's `reduce_broadcast` on one buffer)
    all_to_all  the first half of `collective --shard_update`: CollectiveAllToAllV2, then
                each device adds the pieces of its chunk it received and scales them
    gather      its second half: CollectiveGatherV2 of each device's chunk (1/T of the
                vector), every device receiving the whole
    nothing     the vectors alone (the loop and the reads)

Reported: the median and the fastest microseconds per step over --repeats interleaved
calls. The difference collective - nothing is what the kernel adds to every step of a
model whose gradients travel as one buffer of that size (mgloop packs them so:
--pack_bytes).
"""

from __future__ import annotations

import os
import time

from absl import app, flags
import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_FLAGS = flags.FLAGS
flags.DEFINE_integer("elements", 42506, "floats per device (mlp's gradients on the synthetic "
                     "data: 42506)")
flags.DEFINE_integer("towers", 4, "logical CPU devices")
flags.DEFINE_integer("steps", 200, "steps per compiled loop")
flags.DEFINE_integer("repeats", 15, "timed calls of each loop, interleaved")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from mgloop.cluster import devices as devices_lib
    devices_lib.configure_logical_cpus(_FLAGS.towers)
    import tensorflow as tf
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:_FLAGS.towers]
    count = len(devices)
    values, tokens = [], []
    for device in devices:
        with tf.device(device):
            values.append(tf.Variable(tf.ones([_FLAGS.elements])))
            tokens.append(tf.Variable(0.0, trainable=False))

    def inputs(i):
        out = []
        for device, value in zip(devices, values):
            with tf.device(device):
                out.append(value.read_value() + tf.cast(i, tf.float32))
        return out

    def on_every_device(kernel):
        """xs -> kernel(x, ordering token) on each x's device (a collective's members)."""
        def run(xs):
            out = []
            for device, x, token in zip(devices, xs, tokens):
                with tf.device(device):
                    out.append(kernel(x, [token.handle]))
            return out
        return run

    size = -(-_FLAGS.elements // count)  # the chunk of each device, the vector padded

    def padded(x):
        missing = size * count - _FLAGS.elements
        return tf.pad(x, [[0, missing]]) if missing else x

    collective = on_every_device(lambda x, token: tf.raw_ops.CollectiveReduceV2(
        input=x, group_size=count, group_key=1, instance_key=1, ordering_token=token,
        merge_op="Add", final_op="Div", communication_hint="auto"))

    def all_to_all_and_sum(x, token):
        received = tf.raw_ops.CollectiveAllToAllV2(
            input=tf.reshape(padded(x), [count, size]), group_size=count, group_key=1,
            instance_key=2, ordering_token=token, communication_hint="auto")
        return tf.add_n(tf.unstack(received)) * (1.0 / count)

    all_to_all = on_every_device(all_to_all_and_sum)
    gather = on_every_device(lambda x, token: tf.raw_ops.CollectiveGatherV2(
        input=padded(x)[:size], group_size=count, group_key=1, instance_key=3,
        ordering_token=token, communication_hint="auto"))

    def by_hand(xs):
        with tf.device(devices[0]):
            mean = tf.add_n(xs) * (1.0 / count)
        out = []
        for device in devices:
            with tf.device(device):
                out.append(tf.identity(mean))
        return out

    def loop_of(exchange):
        @tf.function
        def loop(steps):
            total = tf.constant(0.0)
            for i in tf.range(steps):
                total += tf.add_n([x[0] for x in exchange(inputs(i))])
            return total
        return loop

    loops = {"collective": loop_of(collective), "by_hand": loop_of(by_hand),
             "all_to_all": loop_of(all_to_all), "gather": loop_of(gather),
             "nothing": loop_of(lambda xs: xs)}
    steps = tf.constant(_FLAGS.steps)
    for loop in loops.values():
        loop(steps).numpy()  # traced, warmed up
    times = {name: [] for name in loops}
    for _ in range(_FLAGS.repeats):
        for name, loop in loops.items():
            began = time.perf_counter()
            loop(steps).numpy()
            times[name].append((time.perf_counter() - began) / _FLAGS.steps * 1e6)
    print(f"{_FLAGS.elements} floats on {count} logical CPU devices, {_FLAGS.steps} steps a "
          f"loop, {_FLAGS.repeats} repeats")
    print("| loop | median us/step | fastest us/step |\n|---|---|---|")
    for name, values_us in times.items():
        print(f"| {name} | {np.median(values_us):.0f} | {min(values_us):.0f} |")


if __name__ == "__main__":
    app.run(main)
