"""The `colocate` baseline's step (aggregation/dense/colocate.py), beside the tower step.

One shared copy of the variables on the host; each device runs the model on its
slice of the global batch, the outputs are concatenated on the host, ONE loss is
taken over the global batch,

    loss = mean over the global batch of loss_fn(y, concat_t(model(x_t)))

and ONE gradient call differentiates it; TensorFlow places each gradient op beside
its forward op and sums each variable's per-device contributions where it chooses.
The host is the one unit that computes gradients (hook index 0: loss scaling reads
copy 0's scale there). There is no exchange: the gradient is applied once, on the host.
"""

from __future__ import annotations

import tensorflow as tf

from mgloop.aggregation.base import canonical
from mgloop.phases import AGGREGATION, APPLY, COMPUTE
from mgloop.step import non_trainable
from mgloop.step import precision
from mgloop.step import per_tower
from mgloop.step.accumulation import Pass
from mgloop.step.training_step import StepResult


class SingleLossStep:
    def __init__(self, replicas, loss_fn, metrics, hooks, passes, random_streams):
        self.replicas, self.loss_fn, self.metrics = replicas, loss_fn, list(metrics)
        self.hooks, self.passes, self.random_streams = hooks, passes, random_streams

    def __call__(self, shards) -> StepResult:
        """One step on shards[t] = (x_t, y_t): read the shared copy on the host (and its
        state on every device), the single-loss pass (K micro-batches: their mean), the
        towers' states averaged, the update applied on the host, the step advanced."""
        replicas, hooks, aggregation = self.replicas, self.hooks, self.replicas.aggregation
        host = aggregation.devices.host
        with aggregation.step(), hooks.step_scope():
            with tf.name_scope(COMPUTE):
                copy = replicas.copies[0]
                trainable, state = per_tower.read(copy.trainable), per_tower.read(copy.non_trainable)
                states = [[aggregation.send(v, host, device) for v in state]
                          for device in replicas.tower_devices]
                out = self.passes(lambda xs, ys, s: self.single_pass(trainable, xs, ys, s),
                                  [x for x, _ in shards], [y for _, y in shards], states)
            may_apply = hooks.may_apply(out.grads)
            hooks.from_all_workers(hooks.to_all_workers())  # one process: as given
            kept = hooks.after_exchange(out.grads)
            with tf.name_scope(AGGREGATION):
                new_states = non_trainable.combine(aggregation, out.states, replicas.copies,
                                                   replicas.tower_devices)
            with tf.name_scope(APPLY):
                replicas.apply(out.grads, new_states, may_apply)
        done = replicas.advance(also=kept)
        return StepResult(out.losses[0], out.metric_states[0], done, hooks.report(done))

    def single_pass(self, trainable, xs, ys, states) -> Pass:
        """The single loss over every device's slice (see the module docstring)."""
        aggregation, model = self.replicas.aggregation, self.replicas.model
        host, devices = aggregation.devices.host, self.replicas.tower_devices
        streams = self.random_streams
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            outputs, new_states, model_losses = [], [], []
            for t, (x, state, device) in enumerate(zip(xs, states, devices)):
                here = [aggregation.send(v, host, device) for v in trainable]
                with tf.device(device):
                    out, new_state, model_losses = model.stateless_call(
                        here, streams.for_tower(state, t, device), x, return_losses=True,
                        **per_tower.call_kwargs(model, True))
                outputs.append(tf.nest.map_structure(
                    lambda o, d=device: aggregation.send(precision.to_float32(o), d, host), out))
                new_states.append(streams.after_tower(state, new_state))
            with tf.device(host):
                merged = tf.nest.map_structure(lambda *o: tf.concat(o, axis=0), *outputs)
                labels = tf.nest.map_structure(lambda *y: tf.concat(y, axis=0), *ys)
                loss = per_tower.total_loss(self.loss_fn, labels, merged, model_losses)
                scaled = self.hooks.scale_loss(0, loss)
        grads = tape.gradient(scaled, trainable,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        gradient_bytes = sum(g.shape.num_elements() * g.dtype.size for g in grads)
        for device in devices:  # each device's contribution to every gradient
            if canonical(device) != canonical(host):
                aggregation.traffic.record(canonical(device), canonical(host), gradient_bytes)
        with tf.device(host):
            grads = self.hooks.unscale(0, grads)
            metric_state = per_tower.metric_state(self.metrics, labels, merged)
        return Pass([loss], [metric_state], [grads], new_states)
