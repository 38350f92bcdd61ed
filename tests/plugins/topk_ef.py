"""`topk_ef`: top-k sparsification with error feedback, written as a user's plugin.

Load it with `--plugin=tests.plugins.topk_ef --aggregation=topk_ef:ratio=0.5` (or
`Config(plugins=["tests.plugins.topk_ef"], aggregation="topk_ef:ratio=0.5")`).

Each tower t keeps a residual e_t per variable (its state, made by `build` on tower
t's device). Per step and variable of n elements, with k = ceil(ratio * n):

    x_t = g_t + e_t                         (on tower t)
    c_t = x_t on its k largest |entries|, 0 elsewhere; e_t <- x_t - c_t
    out = (1/T) sum_t c_t                   (formed on tower 0 from the k values and
                                             indices each tower sends, then sent to
                                             every replica: the replicas stay identical)

Lossy (Stich et al. 2018): keeping the k largest of n entries leaves
||x - c|| <= q ||x||, q = sqrt(1 - k/n) <= sqrt(1 - ratio); so ||e|| <= q (G + ||e||)
keeps ||e|| <= q G / (1 - q) for every tower gradient norm ||g_t|| <= G, and
out - (1/T) sum_t g_t = (1/T) sum_t (e_t - e_t') is within 2 q / (1 - q) G: the
`error_bound`. Not summable: the towers send values and indices, gathered and
scattered on tower 0, so buckets cannot be summed element-wise. Across workers,
the local stage returns this worker's sum of its towers' c_t (average=False).
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

from mgloop import aggregation


@dataclasses.dataclass(frozen=True)
class TopKOptions(aggregation.Options):
    ratio: float = aggregation.option(
        0.01, "fraction of each gradient's entries a tower sends (the largest in magnitude)",
        low=0.0, high=1.0, low_open=True)


@aggregation.register
class TopKErrorFeedback(aggregation.Aggregation):
    name = "topk_ef"
    options_type = TopKOptions
    capabilities = aggregation.Capabilities(
        layout=aggregation.REPLICATED, exact=False, summable=False,
        unsummable_reason="it gathers each tower's top-k values and indices (no element-wise "
                          "sum)")

    @classmethod
    def error_bound(cls, options, num_towers):
        q = math.sqrt(1.0 - options.ratio)
        return 2 * q / (1 - q) + 4 * num_towers * 2.0 ** -24  # and float32 roundings

    def parameter_devices(self):
        return list(self.devices.towers)

    def build(self, variables):
        self.residuals = []  # residuals[t][v], on tower t's device
        for t, device in enumerate(self.devices.towers):
            with tf.device(device):
                self.residuals.append([
                    tf.Variable(tf.zeros(tuple(v.shape), v.dtype), trainable=False,
                                name=f"topk_ef_residual_{t}_{i}")
                    for i, v in enumerate(variables)])

    @property
    def state_variables(self):
        return [r for per_tower in self.residuals for r in per_tower]

    def reduce(self, tower_values, variables, average=True):
        towers = list(self.devices.towers)
        root = towers[0]
        per_var = []
        for variable in variables:  # the contract: gradients of trainable variables only
            if not getattr(variable, "trainable", True):
                raise TypeError(f"topk_ef was handed the non-trainable {variable.name}")
        for i in range(len(variables)):
            shape, dtype = tower_values[0][i].shape, tower_values[0][i].dtype
            n = shape.num_elements()
            k = min(n, max(1, math.ceil(self.options.ratio * n)))
            received = []
            for t, device in enumerate(towers):
                residual = self.residuals[t][i]
                with tf.device(device):
                    x = tf.reshape(tower_values[t][i] + residual, [-1])
                    _, index = tf.math.top_k(tf.abs(x), k)
                    kept = tf.gather(x, index)
                    residual.assign(tf.reshape(
                        tf.tensor_scatter_nd_update(x, index[:, None], tf.zeros_like(kept)),
                        residual.shape))
                received.append((self.send(kept, device, root), self.send(index, device, root)))
            with tf.device(root):
                total = tf.zeros([n], dtype)
                for kept, index in received:
                    total = tf.tensor_scatter_nd_add(total, index[:, None], kept)
                total = self.scale(tf.reshape(total, shape), average)
            per_var.append([self.send(total, root, device) for device in towers])
        return [list(per_copy) for per_copy in zip(*per_var)]
