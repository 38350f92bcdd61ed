"""`--accumulation_steps=K`: K micro-batches per update, gradients summed on each tower.

A training step receives the examples of K consecutive global batches of B,
concatenated ([K*B, ...]; micro-batch k is rows k*B .. (k+1)*B - 1), already
split per tower by the staging (staging.tower_split): tower t holds the t-th
shard of B/T of every micro-batch, micro-shard k first. Each micro-batch goes
through the towers as an ordinary global batch would, and every unit that
computes gradients (a tower; the host for the single-loss `colocate`) keeps
running sums on its own device:

    G[u]    = (1/K) sum_k g[u][k]          (float32, the variables' dtype)
    loss[u] = (1/K) sum_k loss[u][k]       counts[u] = sum_k counts[u][k]

so the exchange, once per step, averages (1/T) sum_t G[t]: the gradient of the
mean loss over the K*B examples, one step with a K-times larger batch. (The
mean over micro-batches is taken whatever `--grad_reduce` says about towers.)
Non-trainable state (moving statistics) advances once per micro-batch on each
tower, as K forward passes would; the towers' states are averaged once per step,
which equals averaging after every micro-batch since the update is linear.

The K micro-batches run in one `tf.while_loop`, one iteration at a time (the
point of accumulating is to hold one micro-batch's activations), so the graph
does not grow with K and the compiled loop is traced once.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import tensorflow as tf

from mgloop.settings import in_range


@dataclasses.dataclass
class Pass:
    """What the units computed on one micro-batch (or, accumulated, on a step)."""

    losses: list[tf.Tensor]  # per unit: mean loss (scalar)
    accuracy_counts: list[tf.Tensor]  # per unit: float32 [correct, compared] (accuracy.py)
    grads: list[list[tf.Tensor]]  # per unit, per trainable variable, on the unit's device
    states: list[list[tf.Tensor]]  # per tower: non-trainable state after the pass
    # variable index -> sum over towers of its gradient, formed on its home as the towers
    # came (ordered_sum.py, sufficient_factors.py); not to be summed again from `grads`
    sums: dict[int, tf.Tensor] = dataclasses.field(default_factory=dict)


# (per-tower micro-shards xs, ys, per-tower states) -> Pass
MicroPass = Callable[[list[tf.Tensor], list[tf.Tensor], list[list[tf.Tensor]]], Pass]


def _micro_shards(shards: list[tf.Tensor], steps: int) -> list[tf.Tensor]:
    """Each tower's shard [K*b, ...] as [K, b, ...] (micro-shard k = rows k*b .. (k+1)*b - 1)."""
    out = []
    for shard in shards:
        with tf.device(shard.device):
            out.append(tf.reshape(shard, [steps, -1, *shard.shape[1:]]))
    return out


def accumulate(micro_pass: MicroPass, xs: list[tf.Tensor], ys: list[tf.Tensor], steps: int,
               states: list[list[tf.Tensor]], variables: list[tf.Variable],
               unit_devices: list[str]) -> Pass:
    """Runs `micro_pass` on each of the `steps` micro-batches; returns the means.

    xs[t], ys[t] are tower t's shards of the step (K micro-shards each); `states`
    the towers' non-trainable values before the step; `variables` the trainable
    variables (shapes and dtypes of the sums), `unit_devices` where each unit's
    sums live.
    """
    if steps == 1:
        return micro_pass(xs, ys, states)
    micro_x, micro_y = _micro_shards(xs, steps), _micro_shards(ys, steps)
    losses, counts, grads = [], [], []
    for device in unit_devices:  # the sums start at zero on each unit's device
        with tf.device(device):
            losses.append(tf.constant(0.0))
            counts.append(tf.zeros([2], tf.float32))
            grads.append([tf.zeros(v.shape, v.dtype) for v in variables])

    def body(k, losses, counts, grads, tower_states):
        out = micro_pass([x[k] for x in micro_x], [y[k] for y in micro_y], tower_states)
        new_losses, new_counts, new_grads = [], [], []
        for u, device in enumerate(unit_devices):
            with tf.device(device):
                new_losses.append(losses[u] + out.losses[u])
                new_counts.append(counts[u] + out.accuracy_counts[u])
                new_grads.append([total + tf.cast(g, total.dtype)
                                  for total, g in zip(grads[u], out.grads[u])])
        return k + 1, new_losses, new_counts, new_grads, out.states

    loop_vars = (tf.constant(0), losses, counts, grads, states)
    _, losses, counts, grads, states = tf.while_loop(
        lambda k, *_: k < steps, body, loop_vars, parallel_iterations=1,
        maximum_iterations=steps)
    means = []
    for device, loss, grad in zip(unit_devices, losses, grads):
        with tf.device(device):
            means.append((loss * (1.0 / steps), [g * (1.0 / steps) for g in grad]))
    return Pass([m[0] for m in means], counts, [m[1] for m in means], states)


def check_settings(config) -> None:
    """--accumulation_steps >= 1."""
    in_range("accumulation_steps", config.accumulation_steps, low=1)
