"""What a run shows about its towers beyond loss and speed (`--diagnostics` and friends).

In the compiled step (only when `--diagnostics` is on; nothing is traced otherwise),
from the T towers' gradients g_t (after accumulation and loss unscaling, before
the exchange) and mean shard losses loss_t:

    tower_t/loss       loss_t
    tower_t/grad_norm  ||g_t||                      (global norm, on tower t's device)
    grad/norm_ratio    ||(1/T) sum_t g_t|| / ((1/T) sum_t ||g_t||)
    grad/cosine_mean   mean over pairs i < j of cos(g_i, g_j)
                       = (||sum_t u_t||^2 - T) / (T (T - 1)),  u_t = g_t / ||g_t||  (T > 1)

The norm ratio is 1 when every tower's gradient points the same way and
about 1/sqrt(T) when they are independent noise (the signal-to-noise view of
large-batch studies). The sums over towers are formed on the host: each tower
sends g_t and u_t there once per step (2P bytes per tower, outside the traffic
counts, which are the aggregation's). The loop sums these over its steps and the
outer loop writes their mean over each summary window.

Outside the step, at summary time: `replica_divergence` (max |v_c - v_0| over
every replica c and variable element; 0 for the shared layout and for every
synchronous replicated mode, growing under `independent`) and `memory_scalars`.
"""

from __future__ import annotations

import resource
import sys

import tensorflow as tf


def stat_names(num_towers: int) -> list[str]:
    """Names of the in-step statistics, in the order `gradient_stats` returns them."""
    names = [f"tower_{t}/{what}" for t in range(num_towers) for what in ("loss", "grad_norm")]
    names.append("grad/norm_ratio")
    if num_towers > 1:
        names.append("grad/cosine_mean")
    return names


def gradient_stats(losses: list[tf.Tensor], grads: list[list[tf.Tensor]],
                   tower_devices: list[str], host: str) -> list[tf.Tensor]:
    """The statistics of `stat_names(T)` for one step, as float32 scalars on the host."""
    num = len(tower_devices)
    norms, units = [], []
    for g, device in zip(grads, tower_devices):
        with tf.device(device):
            g = [tf.cast(x, tf.float32) for x in g]
            norm = tf.linalg.global_norm(g)
            inverse = tf.math.divide_no_nan(1.0, norm)
            norms.append(norm)
            units.append([x * inverse for x in g])
    with tf.device(host):
        out = []
        for t in range(num):
            out += [tf.cast(losses[t], tf.float32), tf.identity(norms[t])]
        mean_grad = [tf.add_n(list(parts)) / num for parts in zip(*grads)]
        mean_norm = tf.add_n(norms) / num
        out.append(tf.math.divide_no_nan(tf.linalg.global_norm(mean_grad), mean_norm))
        if num > 1:
            unit_sum = [tf.add_n(list(parts)) for parts in zip(*units)]
            squared = tf.square(tf.linalg.global_norm(unit_sum))
            out.append((squared - num) / (num * (num - 1)))
    return out


def replica_divergence(copies) -> float:
    """max over copies c > 0 and trainable elements of |v_c - v_0| (0.0 with one copy)."""
    largest = 0.0
    for copy in copies[1:]:
        for mine, first in zip(copy.trainable, copies[0].trainable):
            with tf.device(copy.device):
                diff = tf.reduce_max(tf.abs(tf.convert_to_tensor(mine)
                                            - tf.convert_to_tensor(first)))
            largest = max(largest, float(diff))
    return largest


def memory_scalars(tower_devices: list[str]) -> dict[str, float]:
    """Peak bytes per device where TensorFlow reports them (GPUs), else the host's peak RSS.

    `memory/<DEVICE>/peak_bytes` from tf.config.experimental.get_memory_info;
    `memory/host/peak_rss_bytes` from getrusage (ru_maxrss: KiB on Linux, bytes on macOS).
    """
    values = {}
    for device in tower_devices:
        if "GPU" not in device.upper():
            continue
        try:
            info = tf.config.experimental.get_memory_info(device)
        except (ValueError, tf.errors.OpError):
            continue
        values[f"memory/{device.split('device:')[-1].replace(':', '_')}/peak_bytes"] = float(
            info["peak"])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    values["memory/host/peak_rss_bytes"] = float(rss if sys.platform == "darwin" else rss * 1024)
    return values
