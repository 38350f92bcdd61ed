"""`dgc:ratio=r,momentum=m,clip_norm=c,memory=residual`: Deep Gradient Compression
(Lin et al. 2018): momentum correction, factor masking, local gradient clipping.

On tower t, per variable of n elements, k = kept(r, n) (topk.py):

    g  <- g * min(1, c_T / ||g||)    local clipping (clip_norm=c > 0), c_T = c sqrt(T), T the
                                     towers of every worker (the paper's c N^(-1/2) rule for
                                     a sum, restated for the mean: the mean of T independent
                                     gradients of norm c sqrt(T) has norm ~ c)
    u  <- m u + g                    momentum correction: momentum accumulated locally
    x  =  v + u                      v: the residual (memory=residual; 0 with none)
    I  =  the k largest |x|          payload (x[I], I), gathered as top-k's (topk.py)
    c  =  x on I, 0 elsewhere
    v  <- x - c,  u <- u on the complement of I  (factor masking: both cleared on I)

u and v are per-tower state. The towers' c are summed by ring all-gather, as top-k
(bytes: (T-1) k values + (T-1) k int32 indices per tower and variable). The momentum
is applied here, so momentum > 0 needs plain SGD (--optimizer=sgd; another optimizer
is refused in one line: it would apply a second momentum). The paper's warm-up of the
sparsity (ratio decreasing over the first epochs) and its sampled threshold (in
place of an exact top-k) are not implemented; ratio=1, momentum=0, clip_norm=0 is
lossless.

Bound (G: the largest tower gradient norm): ||u|| <= G / (1 - m) (masking only clears
entries), the residual ||v|| <= q G / ((1 - q)(1 - m)) with q = sqrt(1 - k/n) (as top-k),
and c_t - g_t = v_old - v_new + m u_old(masked) (+ the clipping, <= G), so

    rho = (2 q / (1 - q) + m) / (1 - m) [+ 1 with clip_norm > 0]

(with memory=none: (q + m) / (1 - m) [+ 1]): large for small ratios, as it must be:
DGC delays what it does not send.
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import option
from mgloop.aggregation.compression.base import Compressed, CompressionOptions, memory_option
from mgloop.aggregation.compression.topk import (RATIO, kept, rounding_bound, scatter,
                                                 sparse_payload)
from mgloop.aggregation.compression.transport import GATHER


@dataclasses.dataclass(frozen=True)
class DgcOptions(CompressionOptions):
    ratio: float = option(0.001, "fraction of each tensor's entries a tower sends (the "
                                 "largest of momentum-corrected accumulations)", **RATIO)
    momentum: float = option(0.9, "momentum applied on each tower before sparsification "
                                  "(train with --optimizer=sgd)", low=0.0, high=1.0,
                             high_open=True)
    clip_norm: float = option(0.0, "local gradient clipping: the norm the averaged gradient "
                                   "is meant to stay under (0: no clipping)", low=0.0)
    memory: str = memory_option("residual", "Lin et al. 2018")


@register
class DeepGradientCompression(Compressed):
    name = "dgc"
    options_type = DgcOptions
    transport = GATHER
    sparse_payload = True

    @classmethod
    def error_bound(cls, options, num_towers):
        q, m = math.sqrt(1.0 - options.ratio), options.momentum
        kept_error = 2 * q / (1 - q) if options.memory == "residual" and q < 1 else q
        clipping = 1.0 if options.clip_norm > 0 else 0.0
        return (kept_error + m) / (1 - m) + clipping + rounding_bound(num_towers) / (1 - m)

    @classmethod
    def applies_momentum(cls, options):
        return options.momentum > 0

    own_state_keys = ("momentum",)  # accumulated from this node's gradients

    def extra_state(self, variable, index, tower):
        return {"momentum": tf.zeros(tuple(variable.shape), variable.dtype)}

    def prepare(self, g, site):
        if self.options.clip_norm > 0:
            g = tf.clip_by_norm(g, self.options.clip_norm * math.sqrt(self.all_towers))
        u = self.options.momentum * tf.reshape(site.state["momentum"], [-1]) + g
        site.notes["u"] = u
        residual = self.residual(site)
        return u if residual is None else tf.reshape(residual, [-1]) + u

    def compress(self, x, site):
        _, index = tf.math.top_k(tf.abs(x), kept(self.options.ratio, site.size))
        site.notes["index"] = index
        return sparse_payload(x, index)

    def decompress(self, payload, site):
        return scatter(payload, site.size)

    def update_state(self, x, sent, site):
        index = site.notes["index"]
        chosen = tf.scatter_nd(tf.expand_dims(index, 1), tf.ones_like(index), [site.size]) > 0
        momentum = site.state["momentum"]
        ops = [momentum.assign(tf.reshape(tf.where(chosen, tf.zeros_like(x), site.notes["u"]),
                                          momentum.shape))]
        residual = self.residual(site)
        if residual is not None:
            ops.append(residual.assign(tf.reshape(tf.where(chosen, tf.zeros_like(x), x),
                                                  residual.shape)))
        return ops
