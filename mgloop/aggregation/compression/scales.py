"""Scales the towers agree on before quantising, and the roundings the quantisers' bounds add.

`shared_max(method, values, devices)`: tower t holds float32 values[t] (e.g. the norms
||x_t||_2 of its buckets); a ring all-gather (transport.py) hands every tower all T of them, sent at
float32 whatever --transport_dtype is (a rounded scale could fall below a tower's norm, and
a tower's own value would differ from its copies elsewhere), and each tower takes their
maximum: the same floats on every tower. Bytes: (T-1) x 4 per value, sent and received
per tower.
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
    """max_t values[t] elementwise (float32 vectors of one shape, values[t] on devices[t]),
    the same on every tower."""
    have = ring_all_gather(method, [(v,) for v in values], devices, exact=True)
    out = []
    for t, device in enumerate(devices):
        with tf.device(device):
            out.append(tf.reduce_max(tf.stack([part for (part,) in have[t]]), axis=0))
    return out
