"""The gradient exchange timed by itself, apart from the step that contains it.

The exchange runs inside the compiled step, where Python cannot time it.
`time_exchange` runs the trainer's own exchange (`Trainer.exchange`: the
aggregation, packing if asked, and the step's two metrics riding along) on
stand-in gradients of the variables' shapes, made once on each tower, `per_call`
times inside one compiled call so that the call's own overhead is shared, and
returns the median over `repeats` calls of call time / per_call. The traffic the
stand-in exchange records is taken back, so the counts stay the step's.

The timing leaves the method as training left it. A method's state (error-feedback
residuals, counters) is held in tf.Variables, since the compiled step updates it;
every variable the timed exchange can read or write is one the traced function
captures (`ConcreteFunction.variables`), so exactly those are snapshotted before
the first timed call and assigned back after the last. (Timing a copy of the
method would need every method to be copyable; measuring the real step would
need a clock inside it. The snapshot is exact and asks nothing of a method.)
"""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf


def time_exchange(trainer, repeats: int = 5, per_call: int = 20) -> float | None:
    """Median seconds of one exchange alone (no tower compute, no update); None for a
    single-loss mode, which has no exchange of its own."""
    if trainer.aggregation.single_loss:
        return None
    stand_ins = []  # random gradients, made once on each tower (not timed)
    for device in trainer.tower_devices:
        with tf.device(device):
            stand_ins.append([tf.random.normal(v.shape, dtype=v.dtype)
                              for v in trainer.copies[0].trainable])

    @tf.function
    def exchanges(tower_grads, count):
        """`count` exchanges of `tower_grads` in one call, each with two stand-in metrics."""
        with tf.device(trainer.aggregation.devices.host):
            metrics = [tf.constant(0.0), tf.zeros([2])]  # the loss, the accuracy counts
        done = tf.constant(0)
        for _ in tf.range(count):
            with tf.control_dependencies(tf.nest.flatten(trainer.exchange(tower_grads,
                                                                          metrics))):
                done += 1
        return done

    counted = trainer.aggregation.traffic.snapshot()
    count = tf.constant(per_call)
    touched = exchanges.get_concrete_function(stand_ins, count).variables  # traces
    trainer.aggregation.traffic.restore(counted)  # keep the step's counts, not the stand-in's
    before = [variable.read_value() for variable in touched]
    try:
        int(exchanges(stand_ins, count))  # warm up
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            int(exchanges(stand_ins, count))
            times.append((time.perf_counter() - began) / per_call)
    finally:
        for variable, value in zip(touched, before):  # the method's state as training left it
            variable.assign(value)
    return float(np.median(times))
