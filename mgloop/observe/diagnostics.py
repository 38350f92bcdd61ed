"""What a run shows about its towers beyond loss and speed (`--diagnostics` and friends).

In the compiled step (only when `--diagnostics` is on; nothing is traced otherwise),
from the T towers' gradients g_t (after accumulation and loss unscaling, before
the exchange) and mean shard losses loss_t:

    tower_t/loss       loss_t
    tower_t/grad_norm  ||g_t||                      (global norm over every variable)
    grad/norm_ratio    ||(1/T) sum_t g_t|| / ((1/T) sum_t ||g_t||)
    grad/cosine_mean   mean over pairs i != j of cos(g_i, g_j)  (T > 1)

and, once every copy holds the step's update,

    replica/divergence max over replicas c > 0 and variable elements of |v_c - v_0|
                       (0 for the shared layout and for every synchronous
                       replicated mode; growing under `independent`; a saw-tooth
                       under `localsgd`/`diloco`, 0 right after each sync)

With --byzantine_towers (step/hooks/attack_hook.py), also `tower_t/byzantine`: 1 if tower t's gradient
was altered by the attack on the sampled step, else 0 (its grad_norm is then the norm of
what it sent).

The norm ratio is 1 when every tower's gradient points the same way and
about 1/sqrt(T) when they are independent noise (the signal-to-noise view of
large-batch studies). All gradient statistics come from the towers' Gram
matrix, formed on the host: each tower sends its flattened gradient there
(P bytes per tower, outside the traffic counts, which are the aggregation's).
They are a sample: computed on the last step of each summary window only (the loop
runs that step apart, `loop.Loop.sampled_once`, as a step with the hook of
hooks/sampled_stats.py in a compiled call of its own, traced at the first sample: the
window's other steps are the step without them) and written as they are.

At summary time, outside the step: `memory_scalars`.
"""

from __future__ import annotations

import resource
import sys

import tensorflow as tf


def stat_names(num_towers: int, byzantine: bool = False) -> list[str]:
    """Names of the sampled step's statistics, in order: those `gradient_stats` returns,
    the divergence, and with `byzantine` each tower's `tower_t/byzantine` flag."""
    names = [f"tower_{t}/loss" for t in range(num_towers)]
    names += [f"tower_{t}/grad_norm" for t in range(num_towers)]
    names.append("grad/norm_ratio")
    if num_towers > 1:
        names.append("grad/cosine_mean")
    names.append("replica/divergence")
    return names + ([f"tower_{t}/byzantine" for t in range(num_towers)] if byzantine else [])


def gradient_stats(losses: list[tf.Tensor], grads: list[list[tf.Tensor]],
                   tower_devices: list[str], host: str) -> tf.Tensor:
    """The statistics of `stat_names(T)` but the last (divergence) for one step: one
    float32 vector on the host.

    Each tower flattens its gradient into one vector f_t on its device; on the host
    the Gram matrix G = F F^T of the stacked F = [f_0; ...; f_{T-1}] gives them all
    (a handful of ops, whatever the model), with n_t = ||g_t|| = sqrt(G_tt):
    norm_ratio = sqrt(sum_ij G_ij) / sum_t n_t, and
    cosine_mean = (sum_ij G_ij / (n_i n_j) - T) / (T (T - 1)).
    """
    num = len(tower_devices)
    flats = []
    for g, device in zip(grads, tower_devices):
        with tf.device(device):
            flats.append(tf.concat([tf.reshape(tf.cast(x, tf.float32), [-1]) for x in g]
                                   or [tf.zeros([0])], 0))  # every variable left out: 0
    with tf.device(host):
        stacked = tf.stack(flats)
        gram = tf.matmul(stacked, stacked, transpose_b=True)
        norms = tf.sqrt(tf.linalg.diag_part(gram))
        ratio = tf.math.divide_no_nan(tf.sqrt(tf.maximum(tf.reduce_sum(gram), 0.0)),
                                      tf.reduce_sum(norms))
        parts = [tf.cast(tf.stack(losses), tf.float32), norms, ratio[None]]
        if num > 1:
            inverse = tf.math.divide_no_nan(1.0, norms)[:, None]
            unit_sum = tf.matmul(inverse, tf.matmul(gram, inverse), transpose_a=True)
            parts.append((tf.reshape(unit_sum, [1]) - num) / (num * (num - 1)))
        return tf.concat(parts, 0)


def replica_divergence(copies) -> tf.Tensor:
    """max over copies c > 0 and trainable elements of |v_c - v_0|, a float32 scalar
    (0 with one copy): each copy's maximum on its device, their maximum on copy 0's."""
    if len(copies) < 2:
        return tf.constant(0.0)
    maxima = []
    for copy in copies[1:]:
        with tf.device(copy.device):
            maxima.append(tf.reduce_max(tf.stack([
                tf.cast(tf.reduce_max(tf.abs(mine.value() - first.value())), tf.float32)
                for mine, first in zip(copy.trainable, copies[0].trainable)])))
    with tf.device(copies[0].device):
        return tf.reduce_max(tf.stack(maxima))


def current_rss_kib() -> int:
    """The process's resident memory now (VmRSS of /proc/self/status, Linux), in KiB:
    what leak checks sample (`memory_scalars` reports the peak)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


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
