"""Scales the towers agree on before quantising, and the roundings the quantisers' bounds add.

`shared_max(method, values, devices)`: tower t holds a float32 scalar values[t] >= 0 (e.g.
||x_t||_2); a ring all-gather (transport.py) hands every tower all T of them and each tower
takes their maximum. Each value travels at --transport_dtype; a tower first rounds its own
value as the wire will (`wire_round`), so that all towers take the maximum of the same T
numbers and agree on it exactly. Below float32 each value is first raised by 2^-7 relative,
so the wire's rounding (at most 2^-8 relative for bfloat16) can only leave it above the
true value: a shared scale is never below any tower's norm. Bytes: (T-1) values sent and
received per tower and variable.
"""

from __future__ import annotations

import math

import tensorflow as tf

from mgloop.aggregation.compression.transport import ring_all_gather
from mgloop.errors import ConfigError


def rounding(num_towers: int) -> float:
    """Relative roundings a decoded value adds to a bound: the largest transport cast of a
    float part (bfloat16, 2^-8) and float32's (u = 2^-24) in the scale, its products and
    the T-term sum and 1/T of the mean."""
    return 2.0 ** -8 + (8 + 4 * num_towers) * 2.0 ** -24


def contraction_bound(q: float, memory: str, num_towers: int) -> float:
    """rho of a compressor with ||x - C(x)|| <= q ||x|| on every tower, for T towers:
    q without memory; with error feedback ||e|| <= q (G + ||e||) holds the residual to
    q G / (1 - q) and out - mean = (1/T) sum_t (e_t(old) - e_t(new)) is within
    2 q / (1 - q) G (inf when q >= 1). Plus `rounding`."""
    if memory == "residual":
        q = 2 * q / (1 - q) if q < 1 else math.inf
    return q + rounding(num_towers) * (1 + q)


def sum_dtype(num_towers: int, largest: int) -> tf.DType:
    """The smallest signed integer type holding any sum of T integers in [-largest, largest]."""
    for dtype in (tf.int8, tf.int16, tf.int32):
        if num_towers * largest <= dtype.max:
            return dtype
    raise ConfigError(f"{num_towers} towers x {largest} levels do not fit an int32 sum; "
                      "use fewer levels")


def shared_max(method, values, devices) -> list[tf.Tensor]:
    """max_t values[t] (float32 scalars >= 0, values[t] on devices[t]), on every tower."""
    raised = 1.0 if method.transport_dtype == tf.float32 else 1.0 + 2.0 ** -7
    payloads = []
    for value, device in zip(values, devices):
        with tf.device(device):
            payloads.append(method.wire_round((tf.reshape(value * raised, [1]),)))
    have = ring_all_gather(method, payloads, devices)
    out = []
    for t, device in enumerate(devices):
        with tf.device(device):
            out.append(tf.reduce_max(tf.concat([part for (part,) in have[t]], axis=0)))
    return out
