"""`--accumulation_steps=K`: K micro-batches per update, gradients summed on each tower.

A training step receives the examples of K consecutive global batches of B,
concatenated ([K*B, ...]; micro-batch k is rows k*B .. (k+1)*B - 1), already
split per tower by the staging (batch_split.tower_split): tower t holds the t-th
shard of B/T of every micro-batch, micro-shard k first. Each micro-batch goes
through the towers as an ordinary global batch would, and every unit that
computes gradients (a tower; the host for the single-loss `colocate`) keeps
running sums on its own device:

    G[u]    = (1/K) sum_k g[u][k]          (float32, the variables' dtype)
    loss[u] = (1/K) sum_k loss[u][k]       metric state[u] = sum_k state[u][k]

so the exchange, once per step, averages (1/T) sum_t G[t]: the gradient of the
mean loss over the K*B examples, one step with a K-times larger batch. (The
mean over micro-batches is taken whatever `--grad_reduce` says about towers.)
Non-trainable state (moving statistics) advances once per micro-batch on each
tower, as K forward passes would; the towers' states are averaged once per step,
which equals averaging after every micro-batch since the update is linear.

The K micro-batches run in one `tf.while_loop`, one iteration at a time (the
point of accumulating is to hold one micro-batch's activations), so the graph
does not grow with K and the compiled loop is traced once. The traffic the pass
records while traced once is counted K times (it runs K times).

Accumulation is a pass wrapper, not a hook (hooks/__init__.py): the step hands
its towers' pass to `passes(...)`, which is `one_pass` or an `Accumulate(K)`
chosen when the step is assembled; only the latter changes the control flow.
Features and labels may be nested (tuples, dicts): every leaf is split alike.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import tensorflow as tf



@dataclasses.dataclass
class Pass:
    """What the units computed on one micro-batch (or, accumulated, on a step)."""

    losses: list[tf.Tensor]  # per unit: mean loss (scalar)
    metric_states: list[tf.Tensor]  # per unit: float32 [M], the metrics' states (metrics.py)
    grads: list[list[tf.Tensor]]  # per unit, per trainable variable, on the unit's device
    states: list[list[tf.Tensor]]  # per tower: non-trainable state after the pass
    # variable index -> sum over towers of its gradient, formed on its home as the towers
    # came (hooks/large_gradients.py); not to be summed again from `grads`
    sums: dict[int, tf.Tensor] = dataclasses.field(default_factory=dict)


# (per-tower micro-shards xs, ys, per-tower states) -> Pass
MicroPass = Callable[[list, list, list[list[tf.Tensor]]], Pass]


def one_pass(micro_pass: MicroPass, xs, ys, states) -> Pass:
    """Without accumulation: the towers' pass once, on the step's shards."""
    return micro_pass(xs, ys, states)


def _micro_shards(shards: list, steps: int) -> list:
    """Each tower's shard (every leaf [K*b, ...]) as [K, b, ...] (micro-shard k = rows
    k*b .. (k+1)*b - 1)."""
    def split(leaf):
        with tf.device(leaf.device):
            return tf.reshape(leaf, [steps, -1, *leaf.shape[1:]])
    return [tf.nest.map_structure(split, shard) for shard in shards]


class Accumulate:
    """`--accumulation_steps=K`: runs a pass on each of K micro-batches; returns the means.

    `variables`: the trainable variables (shapes and dtypes of the sums); `unit_devices`:
    where each unit's sums live; `metric_size`: the length of a unit's metric state;
    `traffic`: the aggregation's counts, whose share of the pass is counted K times.
    """

    def __init__(self, steps: int, variables, unit_devices: list[str], metric_size: int,
                 traffic):
        self.steps, self.variables = steps, list(variables)
        self.unit_devices, self.metric_size, self.traffic = list(unit_devices), metric_size, traffic

    def __call__(self, micro_pass: MicroPass, xs, ys, states) -> Pass:
        """xs[t], ys[t] are tower t's shards of the step (K micro-shards each); `states`
        the towers' non-trainable values before the step."""
        steps, traffic = self.steps, self.traffic
        before = traffic.snapshot()
        micro_x, micro_y = _micro_shards(xs, steps), _micro_shards(ys, steps)
        losses, counts, grads = [], [], []
        for device in self.unit_devices:  # the sums start at zero on each unit's device
            with tf.device(device):
                losses.append(tf.constant(0.0))
                counts.append(tf.zeros([self.metric_size], tf.float32))
                grads.append([tf.zeros(v.shape, v.dtype) for v in self.variables])

        def body(k, losses, counts, grads, tower_states):
            take = lambda shard: tf.nest.map_structure(lambda leaf: leaf[k], shard)
            out = micro_pass([take(x) for x in micro_x], [take(y) for y in micro_y],
                             tower_states)
            new_losses, new_counts, new_grads = [], [], []
            for u, device in enumerate(self.unit_devices):
                with tf.device(device):
                    new_losses.append(losses[u] + out.losses[u])
                    new_counts.append(counts[u] + out.metric_states[u])
                    new_grads.append([total + tf.cast(g, total.dtype)
                                      for total, g in zip(grads[u], out.grads[u])])
            return k + 1, new_losses, new_counts, new_grads, out.states

        loop_vars = (tf.constant(0), losses, counts, grads, states)
        _, losses, counts, grads, states = tf.while_loop(
            lambda k, *_: k < steps, body, loop_vars, parallel_iterations=1,
            maximum_iterations=steps)
        traffic.repeat_since(before, steps)  # traced once, runs K times
        means = []
        for device, loss, grad in zip(self.unit_devices, losses, grads):
            with tf.device(device):
                means.append((loss * (1.0 / steps), [g * (1.0 / steps) for g in grad]))
        return Pass([m[0] for m in means], counts, [m[1] for m in means], states)
