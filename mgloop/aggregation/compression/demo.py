"""`demo:decay=0.999,topk=32,chunk=64,sign=true,mean=senders`: DeMo, Decoupled Momentum
Optimization (Peng, Quesnelle & Kingma 2024, arXiv 2411.19870).

Per step, per tower (at the nodes: per node) t and variable v, on t's device, with
beta = `decay` and the chunked orthonormal DCT-II of dct.py (`chunk` entries per
dimension; E coefficients per chunk, k = min(topk, E)):

    m_t <- beta m_t + g_t                 the decoupled momentum (state per tower)
    Y_t  = DCT(m_t)                       [chunks, E]
    I_t  = the k largest |Y_t| per chunk  payload (Y_t[I_t], I_t), values rounded to
                                          --transport_dtype
    m_t <- m_t - IDCT(Y_t on I_t)         what was sent leaves the local momentum

The payloads are all-gathered (transport.py's ring, or one collective between workers:
peers.py) and every tower forms, for each coefficient j, in tower order,

    Z_j = (sum_{s sent j} Y_s,j) / |{s sent j}|    mean=senders (the reference code's
                                                   scatter mean), 0 if none sent j
    Z_j = (sum_{s sent j} Y_s,j) / T               mean=nodes
    Q   = IDCT(Z);   out = sign(Q) (sign=true, the reference), else Q

so the replicas stay bit-identical. Train with --optimizer=sgd (decay > 0 is refused
with another: the momentum is applied here): with sign=true the learning rate is the
per-element step size, x <- x - lr sign(Q), and weight decay is the optimizer's
(--weight_decay: Keras's decoupled x <- x - lr wd x, as the reference's). With
--grad_reduce=sum the output is T times the above.

Bytes per tower and variable: (T - 1) payloads each way of chunks * k values at
--transport_dtype and ceil(chunks * k * b / 8) bytes of indices bit-packed at
b = ceil(log2 E) bits (12 for 64 x 64 chunks); b = 0 (no indices) when k = E, the
coefficients then travel in their own order.

Where mgloop differs from the reference code (github:bloc97/DeMo, demo.py): the
momentum accumulates g, not lr g (equal at a constant learning rate: top-k and sign
do not see a positive scale); tensors of rank > 2 are chunked as [prod(shape[:-1]),
shape[-1]] (the reference takes rank <= 2); top-k ties go to the lower index
(tf.math.top_k; torch's order is unspecified); the transmitted estimate is formed
from the values as rounded for the wire, so the momentum keeps what the cast lost;
indices travel bit-packed, not as int64; sign=false and mean=nodes are mgloop's.

Bound (contract `error_bound`): sign=true, none (inf: sign(Q) has norm up to sqrt(n) whatever
the gradients' scale). sign=false, G the largest tower gradient norm: top-k keeps at
least k/E >= r = min(1, topk/chunk^2) of each chunk's energy, so with the wire cast
(relative 2^-8 at most) ||m_new|| <= q ||beta m + g||, q = sqrt(1 - r (1 - 2^-16)),
hence ||m|| <= M = q G / (1 - q beta); with mean=nodes Q - mean_t g_t =
(1/T) sum_t (beta m_t(old) - m_t(new)), so rho = (1 + beta) q / (1 - q beta); with
mean=senders (and r < 1) each Z_j differs from the nodes' mean by at most
(1 - 1/T) max_t |Y_t,j| (the sent value, cast: 1 + 2^-8 of it), adding
(1 - 1/T) sqrt(T) (1 + 2^-8) (beta M + G) / G; the float32
transforms (dct.py, eps per dimension) enter to first order as (1 + 8 eps) rho + 8 eps.
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import Options, option
from mgloop.aggregation.compression import dct, transport
from mgloop.aggregation.compression.base import Compressed
from mgloop.aggregation.compression.transport import GATHER, gather_in_buckets
from mgloop.aggregation.kernels import bitpacking
from mgloop.errors import ConfigError

MEANS = ("senders", "nodes")


@dataclasses.dataclass(frozen=True)
class DemoOptions(Options):
    decay: float = option(0.999, "beta of the decoupled momentum m <- beta m + g kept on each "
                                 "node (Peng et al. 2024: 0.999)", low=0.0, high=1.0,
                          high_open=True)
    topk: int = option(32, "DCT coefficients each node sends per chunk, the largest in "
                           "magnitude (paper: 32)", low=1)
    chunk: int = option(64, "entries per dimension of a DCT chunk (the largest divisor of "
                            "the dimension up to this; paper: 64)", low=1)
    sign: bool = option(True, "apply sign(Q), the reference's signSGD step (the learning "
                              "rate is then the per-element step); false: Q itself")
    mean: str = option("senders", "a coefficient's mean over the nodes that sent it "
                                  "(senders, the reference code) or over all nodes",
                       choices=MEANS)


@register
class Demo(Compressed):
    name = "demo"
    options_type = DemoOptions
    transport = GATHER
    # Its output is not a sum of per-tower contributions (a scatter mean, then a sign), so
    # workers cannot add dense local sums: between workers it runs at the nodes.
    capabilities = Compressed.capabilities.but(across_workers=False)

    @property
    def uses_memory(self) -> bool:
        return False  # the momentum is the method's state, not an error-feedback residual

    @classmethod
    def check(cls, request, options):
        if options.topk > options.chunk ** 2:
            raise ConfigError(f"--aggregation=demo: topk={options.topk} exceeds the "
                              f"{options.chunk ** 2} coefficients of a chunk of chunk="
                              f"{options.chunk} per dimension; use topk <= chunk^2")

    @classmethod
    def applies_momentum(cls, options):
        return options.decay > 0

    @classmethod
    def error_bound(cls, options, num_towers):
        if options.sign:
            return math.inf
        beta, ratio = options.decay, min(1.0, options.topk / options.chunk ** 2)
        q = math.sqrt(1.0 - ratio * (1.0 - 2.0 ** -16))
        momentum = q / (1.0 - q * beta)  # M / G
        rho = (1.0 + beta) * momentum
        if options.mean == "senders" and ratio < 1:
            rho += ((1.0 - 1.0 / num_towers) * math.sqrt(num_towers) * (1.0 + 2.0 ** -8)
                    * (beta * momentum + 1.0))
        eps = dct.transform_bound(options.chunk)
        return (1.0 + 8 * eps) * rho + 8 * eps

    # ---- per tower: momentum, coefficients, top-k, what leaves the momentum ----
    def chunking(self, site) -> dct.Chunking:
        return dct.Chunking.of(site.shape, self.options.chunk)

    def kept(self, chunking: dct.Chunking) -> int:
        return min(self.options.topk, chunking.elements)

    def index_bits(self, chunking: dct.Chunking) -> int:
        """b: 0 when every coefficient is sent (in order), else ceil(log2 E)."""
        if self.kept(chunking) == chunking.elements:
            return 0
        return bitpacking.index_bits(chunking.elements)

    own_state_keys = ("momentum",)  # accumulated from this node's gradients

    def extra_state(self, variable, index, tower):
        return {"momentum": tf.zeros(tuple(variable.shape), variable.dtype)}

    def prepare(self, g, site):
        return self.options.decay * tf.reshape(site.state["momentum"], [-1]) + g

    def compress(self, x, site):
        chunking = self.chunking(site)
        coefficients = chunking.encode(x)
        if self.index_bits(chunking) == 0:
            return (coefficients,)
        _, index = tf.math.top_k(tf.abs(coefficients), self.kept(chunking))
        return tf.gather(coefficients, index, batch_dims=1), index

    def positions(self, payload: tuple, chunking: dct.Chunking) -> tf.Tensor:
        """[chunks * k, 1] int32: each value's flat position among the chunks * E."""
        if len(payload) == 1:
            return tf.range(chunking.chunks * chunking.elements)[:, None]
        offsets = tf.range(chunking.chunks)[:, None] * chunking.elements
        return tf.reshape(payload[1] + offsets, [-1, 1])

    def decompress(self, payload, site):
        chunking = self.chunking(site)
        dense = tf.scatter_nd(self.positions(payload, chunking), tf.reshape(payload[0], [-1]),
                              [chunking.chunks * chunking.elements])
        return chunking.decode(tf.reshape(dense, [chunking.chunks, chunking.elements]))

    def update_state(self, x, sent, site):
        momentum = site.state["momentum"]
        return [momentum.assign(tf.reshape(x - sent, momentum.shape))]

    def pack(self, payload, site):
        if len(payload) == 1:
            return payload
        values, index = payload
        return values, bitpacking.pack_bit_fields(index, self.index_bits(self.chunking(site)))

    def unpack_rows(self, wires, site):
        if len(wires) == 1:
            return wires
        values, packed = wires  # [R, chunks, k] and [R, bytes]
        chunking = self.chunking(site)
        index = bitpacking.unpack_bit_fields_rows(packed, values.shape[1:].num_elements(),
                                                  self.index_bits(chunking))
        return values, tf.reshape(index, values.shape)

    # ---- every tower: the mean of the gathered coefficients, its IDCT, its sign ----
    def combine(self, payloads: tuple, site) -> tf.Tensor:
        """Q (flat) from every tower's payload (`unpack_rows`: [T, ...] parts), added in
        tower order (module docstring): one scatter-add per tower, of its row."""
        chunking = self.chunking(site)
        size = chunking.chunks * chunking.elements
        senders = payloads[0].shape[0]
        values = tf.unstack(tf.reshape(payloads[0], [senders, -1]))
        if len(payloads) == 1:  # every coefficient sent: the same positions for each
            positions = [self.positions(payloads, chunking)] * senders
        else:
            offsets = tf.range(chunking.chunks)[:, None] * chunking.elements
            positions = tf.unstack(tf.reshape(payloads[1] + offsets, [senders, -1, 1]))
        total = tf.zeros([size], site.dtype)
        count = tf.zeros([size], site.dtype)
        for where, row in zip(positions, values):
            total = tf.tensor_scatter_nd_add(total, where, row)
            count = tf.tensor_scatter_nd_add(count, where, tf.ones_like(row))
        if self.options.mean == "senders":
            mean = tf.math.divide_no_nan(total, count)
        else:
            mean = total / tf.constant(senders, site.dtype)
        return chunking.decode(tf.reshape(mean, [chunking.chunks, chunking.elements]))

    def reduce(self, tower_values, variables, average=True):
        towers = list(self.devices.towers)
        encoded = [self.encode(tower_values, i) for i in range(len(variables))]
        gathered = gather_in_buckets(self, encoded, list(range(len(variables))))
        per_var = []
        for i, e in enumerate(encoded):
            outs = []
            for t, (device, shared) in enumerate(zip(
                    towers, transport.shares_with(towers, gathered[i]))):
                if shared is not None:  # one device's towers: the same ops on the same inputs
                    outs.append(outs[shared])
                    continue
                with tf.device(device):
                    q = self.combine(self.unpack_rows(transport.stacked(gathered[i][t]),
                                                      e.sites[t]), e.sites[t])
                    out = tf.sign(q) if self.options.sign else q
                    if not average:
                        out = out * tf.constant(self.num_towers, out.dtype)
                    outs.append(tf.reshape(out, e.sites[t].shape))
            per_var.append(outs)
        for t, device in enumerate(towers):
            with tf.device(device):
                self.steps[t].assign_add(1)
        return [list(per_copy) for per_copy in zip(*per_var)]
