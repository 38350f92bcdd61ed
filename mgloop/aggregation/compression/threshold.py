"""`threshold:value=v,memory=residual`: every entry with |x| >= v is sent, the rest kept.

On tower t (Strom 2015, "Scalable distributed DNN training using commodity GPU cloud
computing", INTERSPEECH), per variable of n entries: x_t = g_t + e_t (memory=residual,
the default; x_t = g_t with none), I_t = {j : |x_t[j]| >= v}, the payload is
(x_t[I_t], I_t) with k_t = |I_t| entries, decided by the data; c_t = x_t on I_t and 0
elsewhere, e_t <- x_t - c_t (exactly: complementary entries, so |e_t| < v entry-wise), and
every tower returns (1/T) sum_s c_s. value=0 sends every entry: lossless. Strom's
payload is one 32-bit word per entry (a 31-bit index and the sign, the value being +-v);
here the value itself travels (at --transport_dtype) with its index, so the sum is of the
x_t[j] that pass, not of +-v.

Transport: sizes first (sizes_first.py), variable size. Each sender all-gathers its counts
k_{s,i} (int32 per variable), then its values and indices of every variable padded with
zeros to M_i = max_s k_{s,i} as one buffer; every tower keeps each sender's first k_{s,i}
entries and scatter-adds them in sender order. The same code runs between the towers of
one process, between simulated nodes' leaders and between real workers (one
CollectiveGatherV2, which needs equal shapes: hence the padding).

Bytes, what travels, padding included (sizes_first.py), per participant of S and step,
sent and received alike, V variables, a_v value bytes, a_i index bytes (the narrowest
integer type for n_i: uint8 to 256 entries, uint16 to 65,536, else int32):

    (S-1) (4 V + sum_i M_i (a_v + a_i))      [between workers the payload buffer is
                                              padded to whole int32s, at least one]

so a step in which fewer entries pass moves fewer bytes; the payload's part is counted
when the step runs (aggregation/measured.py: int64 totals per device in this method's
state), its messages and the sizes when traced, and the link report averages the run's
steps. It models a collective all-gather, whose cost follows the largest sender: with
senders of very different counts, a transport of variable-size messages (unpadded) would
move sum_{s' != s} k_{s',i} instead, which is not built.

Bound: without memory ||c_t - g_t|| <= ||g_t||, rho = 1. With memory the error is
absolute (|e| < v entry-wise: out is within 2 v sqrt(n) of the mean), not relative to
G, so `error_bound` is infinite. value=0: every entry passes and out is the sum in sender
order ((0 + c_0) + c_1) + ..., times fl(1/T), within gamma_{T+1} sum_t |g_t| / T of the
mean (gamma_n = n u / (1 - n u), u = 2^-24: T-1 additions, 1/T and the product rounded).
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import option
from mgloop.aggregation.compression import sizes_first
from mgloop.aggregation.compression.base import Compressed, CompressionOptions, memory_option
from mgloop.aggregation.compression.topk import rounding_bound, scatter, sparse_payload
from mgloop.aggregation.measured import MeasuredBytes


@dataclasses.dataclass(frozen=True)
class ThresholdOptions(CompressionOptions):
    value: float = option(0.01, "entries with |x| >= value are sent (0: every entry)", low=0.0)
    memory: str = memory_option("residual", "Strom 2015")


@register
class Threshold(Compressed):
    name = "threshold"
    options_type = ThresholdOptions
    transport = sizes_first.SIZES_FIRST
    sparse_payload = True  # (values, indices), indices packed at the narrowest type
    # one payload buffer per step for every variable already
    capabilities = Compressed.capabilities.but(buckets_payloads=False)

    def __init__(self, devices, options=None, transport_dtype="float32", **construction):
        super().__init__(devices, options, transport_dtype, **construction)
        self.measured = MeasuredBytes(self.name)

    @classmethod
    def error_bound(cls, options, num_towers):
        if options.memory == "residual" and options.value > 0:
            return math.inf
        return 1.0 + rounding_bound(num_towers)

    def build(self, variables):
        super().build(variables)
        self.measured.build(self.devices.towers)

    @property
    def state_variables(self):
        return super().state_variables + self.measured.variables

    def compress(self, x, site):
        return sparse_payload(x, tf.where(tf.abs(x) >= self.options.value)[:, 0])

    def decompress(self, payload, site):
        return scatter(payload, site.size)

    def exchange_encoded(self, encoded):
        return sizes_first.combine(self, encoded)
