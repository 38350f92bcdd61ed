"""Replicated methods driven by hand: copies holding given values, inner steps made of
seeded noise, and two runs of the same batches side by side (the tests of local-update
methods: streaming DiLoCo, SparseLoCo, SPARTA)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from mgloop import aggregation
from mgloop.cluster import devices
from mgloop.step import replicas
from mgloop.training.variables import VariableCopy
from tests import helpers

F32 = np.float32


def method_on_copies(spec: str, towers: int, init, values=None, step_fn=True,
                     **construction):
    """The method `spec` on cpu:`towers` (made with `construction`, e.g. node_speeds), one
    copy per tower holding `values[c]` (default `init` on every copy), its state built from
    `init`; with `step_fn`, also its `after_update` traced once (a concrete function)."""
    device_set = devices.setup(devices.parse(f"cpu:{towers}"))
    method = aggregation.make(spec, device_set, **construction,
                              step_counter=replicas.global_step_on(device_set.host))
    copies = []
    for device, held in zip(device_set.towers, values or [init] * towers):
        with tf.device(device):
            copies.append(VariableCopy(device, [tf.Variable(w) for w in held], []))
    method.build(copies[0].trainable if values is None else [tf.Variable(w) for w in init])
    if not step_fn:
        return method, copies
    with method.step():
        after_update = tf.function(lambda: method.after_update(copies)).get_concrete_function()
    return method, copies, after_update


def inner_steps_by_hand(v, copies, rng, shapes, scale=0.1) -> None:
    """Each copy's parameters moved by its own seeded noise (the model's v[c][i] and the
    copy's variable alike), as its inner optimizer would between syncs."""
    for c, copy in enumerate(copies):
        for i, variable in enumerate(copy.trainable):
            v[c][i] = v[c][i] + F32(scale) * rng.standard_normal(shapes[i]).astype(F32)
            variable.assign(v[c][i])


def trained_side_by_side(tmp_path, specs, towers: int, steps: int):
    """Each spec trained on the same `steps` batches of the small config (tests/helpers.py):
    [(trainer, every copy's weights)] in the order of `specs`; asserts the first moved."""
    batches = helpers.batches(steps)
    results = []
    for spec in specs:
        config = helpers.small_config(str(tmp_path / spec.split(":")[0]),
                                      devices=f"cpu:{towers}", aggregation=spec)
        trainer = helpers.build_trainer(config)
        start = helpers.copy_weights(trainer)[0]
        helpers.run_batches(trainer, batches)
        results.append((trainer, helpers.copy_weights(trainer)))
        if len(results) == 1:
            assert np.abs(results[0][1][0][0] - start[0]).max() > 1e-4  # it trained
    return results


def assert_copies_equal(got, want) -> None:
    """Every copy's every weight bit for bit."""
    for a, b in zip(got, want):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def method_at_nodes(config):
    """(the method between the nodes of a validated `config`, with its --node_failures
    schedule, on cpu devices as many as its towers; the schedule)."""
    from mgloop.aggregation.placement import between_nodes, node_failures
    device_set = devices.setup(devices.parse(config.devices))
    schedule = node_failures.schedule_of(config.exchange, config.train_steps)
    method = between_nodes.make(config.exchange, device_set, aggregation.make,
                                failures=schedule,
                                step_counter=replicas.global_step_on(device_set.host))
    return method, schedule
