"""The gradient exchange timed by itself, apart from the step that contains it.

The exchange runs inside the compiled step, where Python cannot time it.
`time_exchange` runs the step's own exchange path (`TowerStep.exchange_alone`:
the hooks' `after_tower` and `home_sums`, i.e. large gradients sent to their
homes and summed there (ordered sum, sufficient factors), then the exchange:
the aggregation, packing if asked, and the step's loss and metric states riding
along) on stand-in tower outputs shaped as the last traced step's (gradients,
and factors where the step factored), made once on each tower, `per_call` times
inside one compiled call so that the call's own overhead is shared, and
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

from mgloop.training import metrics as metrics_lib
from mgloop.step.per_tower import TowerOutput


def _random_like(value, variable=None):
    """Random values of `value`'s shape; for rows (IndexedSlices, sparse_gradients.py) as
    many random rows of `variable`, so the timed exchange moves rows as the step's does."""
    if isinstance(value, tf.IndexedSlices):
        indices = tf.random.uniform(value.indices.shape, 0, variable.shape[0],
                                    dtype=value.indices.dtype)
        return tf.IndexedSlices(_random_like(value.values), indices,
                                tf.constant(variable.shape.as_list(), value.indices.dtype))
    return None if value is None else tf.random.normal(value.shape, dtype=value.dtype)


def stand_ins(trainer) -> list[TowerOutput]:
    """Random tower outputs shaped as the last traced step's (its gradients, None where it
    factored, and its factors), or full gradients of every variable before any step;
    made on each tower (not timed)."""
    traced = trainer.step.tower_outputs
    outputs = []
    for t, device in enumerate(trainer.tower_devices):
        with tf.device(device):
            if traced:
                grads = [_random_like(g, v)
                         for g, v in zip(traced[t].grads, trainer.copies[0].trainable)]
                factors = {i: (_random_like(x), _random_like(dz))
                           for i, (x, dz) in traced[t].factors.items()}
            else:
                grads = [_random_like(v) for v in trainer.copies[0].trainable]
                factors = {}
        outputs.append(TowerOutput(tf.constant(0.0), tf.zeros([0]), grads, [], factors))
    return outputs


def time_exchange(trainer, repeats: int = 5, per_call: int = 20) -> float | None:
    """Median seconds of one exchange alone, large-gradient sums at home included (no
    tower compute, no update); None for a single-loss mode, which has no exchange."""
    if trainer.aggregation.capabilities.single_loss:
        return None
    outputs = stand_ins(trainer)
    size = metrics_lib.total_size(trainer.metrics)

    @tf.function(autograph=False)  # as the step and the loop (loop.py)
    def exchanges(count):
        """`count` exchanges of the stand-in outputs in one call, with stand-in metrics."""
        with tf.device(trainer.aggregation.devices.host):
            metrics = [tf.constant(0.0), tf.zeros([size])]  # the loss, the metric states

        def one(done):
            exchanged = trainer.step.exchange_alone(outputs, metrics)
            with tf.control_dependencies(tf.nest.flatten(exchanged)):
                return done + 1
        return tf.while_loop(lambda done: done < count, one, [tf.constant(0)])[0]

    counted = trainer.aggregation.traffic.snapshot()
    count = tf.constant(per_call)
    touched = exchanges.get_concrete_function(count).variables  # traces
    trainer.aggregation.traffic.restore(counted)  # keep the step's counts, not the stand-in's
    before = [variable.read_value() for variable in touched]
    try:
        int(exchanges(count))  # warm up
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            int(exchanges(count))
            times.append((time.perf_counter() - began) / per_call)
    finally:
        for variable, value in zip(touched, before):  # the method's state as training left it
            variable.assign(value)
    return float(np.median(times))
