"""`colocate`: the single-loss baseline of Keras `multi_gpu_model` / `make_parallel`.

Rebuilt for TF2 so that the ablation can compare it with the tower loop. One
shared copy of the variables on the host CPU (the merge device); the global
batch is sliced per device and each device runs the model on its slice, but
there is no per-tower loss or gradient: the outputs are concatenated on the
host, ONE loss is taken over the global batch,

    loss = mean over the global batch of loss_fn(y, concat_t(model(x_t)))

and ONE gradient call differentiates it. TensorFlow places each gradient op
beside its forward op and sums each variable's per-device contributions
wherever it chooses: nothing in mgloop averages anything. The update is
applied once, on the host. Mathematically the same gradient as the tower loop
(the mean over the global batch), so it equals the single-device run to float
tolerance; what differs is where the work and the copies happen.
"""

from __future__ import annotations

import tensorflow as tf

from mgloop import accuracy
from mgloop import precision
from mgloop import towers
from mgloop.aggregation import register
from mgloop.aggregation.base import canonical
from mgloop.aggregation.parameter_server import ParameterServerCpu


@register
class Colocate(ParameterServerCpu):
    name = "colocate"
    exchanges = False
    single_loss = True
    across_workers = False  # the single loss is over one process's towers

    def single_loss_step(self, model, loss_fn, trainable, states, xs, ys, loss_scale=None):
        """(loss, accuracy counts [correct, compared], grads, per-tower non-trainable
        state) of one single-loss step.

        `trainable`: the shared copy's values on the host; `states[t]`: tower t's
        non-trainable state, on its device. With a `loss_scale` S (on the host),
        the gradient call differentiates S * loss and the gradients are divided by S.
        """
        host = self.devices.host
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            outputs, new_states = [], []
            for x, state, device in zip(xs, states, self.devices.towers):
                here = [self.send(v, host, device) for v in trainable]
                with tf.device(device):
                    logits, new_state, losses = model.stateless_call(
                        here, state, x, return_losses=True, **towers.call_kwargs(model, True))
                outputs.append(self.send(precision.to_float32(logits), device, host))
                new_states.append(list(new_state))
            with tf.device(host):
                merged = tf.concat(outputs, axis=0)
                labels = tf.concat(ys, axis=0)
                loss = towers.mean_loss(loss_fn, labels, merged)
                if losses:
                    loss += tf.add_n([tf.cast(l, loss.dtype) for l in losses])
                scaled = loss if loss_scale is None else loss * loss_scale
        grads = tape.gradient(scaled, trainable,
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        gradient_bytes = sum(g.shape.num_elements() * g.dtype.size for g in grads)
        for device in self.devices.towers:  # each device's contribution to every gradient
            if canonical(device) != canonical(host):
                self.traffic.record(canonical(device), canonical(host), gradient_bytes)
        with tf.device(host):
            if loss_scale is not None:
                grads = [g / loss_scale for g in grads]
            counts = accuracy.counts(loss_fn, labels, merged)
        return loss, counts, grads, new_states
