"""`sparseloco`: DiLoCo whose outer gradients travel as sparse 2-bit payloads with error feedback.

SparseLoCo (Sarfi, Thérien, Lidin and Belilovsky 2025, "Communication Efficient LLM
Pre-training with SparseLoCo", arXiv 2508.15706). Inner steps as `diloco`
(local_steps.py): T copies (nodes), one per tower, each applying its own tower's gradient
with its own optimizer, no gradient exchange. After the step s that closes a period
(s + 1 mod H = 0, `diloco`'s `due`), on every copy c, for every trainable variable:

    Delta_c = x - v_c                        the pseudo-gradient (x: the parameters every
                                             copy took at the last sync)
    e_c    <- beta e_c + Delta_c             the error feedback (`decay` = beta)
    p_c     = C(e_c)                         chunk-wise top-k, quantised (chunked_topk.py)
    e_c    <- e_c - p_c                      only where p_c was kept: what was sent, decoded
    Delta   = (1/T) sum_c p_c                every node's payload all-gathered (GATHER,
                                             transport.py's ring_all_gather) and added in
                                             node order, 0..T-1, on every copy alike
    x      <- x - alpha Delta,   v_c <- x    (`outer_lr` = alpha; plain SGD)

No outer momentum: the paper replaces DiLoCo's outer Nesterov momentum by the error
feedback (its beta), so a sync is Delta alone. `average=contributors` divides each entry by
the number of nodes that sent it instead of T (the reference code's scatter_reduce "mean",
which differs from the paper's (1/T) sum where the nodes' top-k disagree).

Not modelled from the reference code: its decoupled weight decay of x; its
e <- beta e + alpha Delta (the buffer takes alpha Delta; the same at the paper's alpha = 1).

Payload. Each node's wire parts of every variable (chunked_topk.py: packed indices, packed
codes, codebook) are concatenated into one uint8 buffer (bitpacking.to_bytes), gathered
as one message per ring step and split back; floats travel as float32 (`exact`). A node
sends and receives (T - 1) P bytes per sync, P = sum over variables of
`ChunkedTopK.wire_bytes` (between workers peers.py pads the buffer to whole int32s); DiLoCo's
ring sends 2 (T-1)/T 4 n bytes for n parameters. At 2% density, 2-bit values and 12-bit
indices, P ~ n (0.02 x 14 bits) / 8 + 20 B per variable: a 128 x 128 kernel's P is 594 B,
so a sync moves (2/T) x 65536 / 594 = (2/T) x 110.3 times less than DiLoCo's
(docs/methods/sparseloco.md). The traffic is recorded on the occasion "sync".

State per copy (checkpointed; between workers every node's own, node_checkpoint.py): x
(`sparseloco_start_c`) and e (`sparseloco_error_c`, float32), each shaped as its variable.
Every copy computes x from the same gathered bits in the same order, so x is equal on
every copy; e differs per node.

Lossless: density=1, value_bits=0, decay=0 gives Delta = (1/T) sum_c (x - v_c), what
`diloco:outer_momentum=0` computes as x - (1/T) sum_c v_c: equal in exact arithmetic, and in
float32 within u ((T + 2)(D + V) + 2 |x|) per element (u = 2^-24, D = max_c |x - v_c|,
V = max_c |v_c|, alpha = 1), bit for bit when every subtraction and sum is exact
(tests/test_sparseloco.py). Identity: with period=1 and outer_lr=1 too it is synchronous
training (x - (x - a) = a) up to those roundings.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import Options, option
from mgloop.aggregation.compression.transport import ring_all_gather
from mgloop.aggregation.kernels import bitpacking
from mgloop.aggregation.kernels.chunked_topk import ChunkedTopK, Geometry
from mgloop.aggregation.local.local_steps import DiLoCo
from mgloop.training.variables import backing

F32 = np.float32


@dataclasses.dataclass(frozen=True)
class SparseLoCoOptions(Options):
    period: int = option(15, "H: inner steps between outer steps (the paper's smallest H)",
                         low=1)
    outer_lr: float = option(1.0, "alpha: the outer SGD's learning rate (no outer momentum)",
                             low=0.0, low_open=True)
    decay: float = option(0.95, "beta: error feedback e <- beta e + Delta", low=0.0, high=1.0)
    density: float = option(0.015625, "fraction of each chunk sent (k = round(density L); "
                                      "64 of a 64x64 chunk)", low=0.0, high=1.0,
                            low_open=True)
    chunk: int = option(64, "side of the chunks: a matrix in chunk x chunk blocks, a vector "
                            "in runs of chunk (largest divisors at most this)", low=1)
    value_bits: int = option(2, "bits per sent value on a per-tensor codebook of 2^b bins; "
                                "0: float32 values", choices=tuple(range(9)))
    sigmas: float = option(6.0, "the quantiser's range in standard deviations", low=0.0,
                           low_open=True)
    average: str = option("all", "Delta = (1/T) sum_c p_c (all, the paper's) or each entry "
                                 "over the nodes that sent it (contributors, the reference "
                                 "code's)", choices=("all", "contributors"))


@register
class SparseLoCo(DiLoCo):
    name = "sparseloco"
    options_type = SparseLoCoOptions
    capabilities = DiLoCo.capabilities.but(
        identity="period=1,outer_lr=1,decay=0,density=1,value_bits=0")

    @property
    def compressor(self) -> ChunkedTopK:
        return ChunkedTopK(self.options.density, self.options.value_bits, self.options.sigmas)

    def build(self, variables):
        """x (the initial parameters) and e (zeros), one list per copy on its device, and
        every variable's chunk geometry."""
        self.geometries = [Geometry.of(v.shape, self.options.chunk) for v in variables]
        self._start, self._error = [], []
        for c, device in enumerate(self.parameter_devices()):
            with tf.device(device):
                names = [v.name.split(":")[0] for v in variables]
                self._start.append([tf.Variable(v.read_value(), trainable=False,
                                                name=f"sparseloco_start_{c}/{name}")
                                    for v, name in zip(variables, names)])
                self._error.append([tf.Variable(tf.zeros(v.shape, tf.float32), trainable=False,
                                                name=f"sparseloco_error_{c}/{name}")
                                    for v, name in zip(variables, names)])

    @property
    def state_variables(self):
        return [v for pair in zip(self._start, self._error) for vs in pair for v in vs]

    def rejoined(self, copies) -> None:
        """DiLoCo's rule (copies take x), and the joining node's error feedback e at 0."""
        super().rejoined(copies)
        for errors in self._error:
            for e in errors:
                e.assign(tf.zeros_like(e))

    def payload_bytes(self) -> int:
        """P: the bytes of one node's buffer (module docstring)."""
        return sum(self.compressor.wire_bytes(g) for g in self.geometries)

    def synchronise(self, copies) -> None:
        """The outer step (module docstring) on every copy."""
        compressor, decay = self.compressor, F32(self.options.decay)
        accumulated, buffers, likes = [], [], []
        for c, copy in enumerate(copies):
            with tf.device(copy.device):
                per_variable = []
                for target, x, e, geometry in zip(copy.trainable, self._start[c],
                                                  self._error[c], self.geometries):
                    delta = tf.cast(x.read_value() - backing(target).read_value(), tf.float32)
                    per_variable.append(geometry.chunk(decay * e.read_value() + delta))
                parts = compressor.encode_many(per_variable, self.geometries)
                accumulated.append(per_variable)
                likes = [p for wire in parts for p in wire]  # the same shapes on every copy
                buffers.append((bitpacking.to_bytes(likes),))
        have = ring_all_gather(self, buffers, [copy.device for copy in copies], exact=True)
        first = self.tower_offset  # this process's copy 0 among all T
        width = 2 if not self.options.value_bits else 3
        for c, copy in enumerate(copies):
            with tf.device(copy.device):
                # the T received buffers decoded as one batch (each row by itself: the same
                # values as one by one, and a trace that does not grow with T)
                parts = iter(bitpacking.from_bytes_rows(tf.stack([raw for (raw,) in have[c]]),
                                                        likes))
                for i, geometry in enumerate(self.geometries):
                    index, values = compressor.decode_rows(
                        tuple(next(parts) for _ in range(width)), geometry)
                    places = tf.unstack(geometry.places_rows(index))
                    values = tf.unstack(values)
                    self._error[c][i].assign(geometry.unchunk(tf.tensor_scatter_nd_sub(
                        accumulated[c][i], places[first + c], values[first + c])))
                    delta = self.combine(places, values, geometry)
                    x = self._start[c][i]
                    x.assign(x - F32(self.options.outer_lr) * tf.cast(delta, x.dtype))
                    copy.trainable[i].assign(x.read_value())

    def combine(self, places: list, values: list, geometry: Geometry) -> tf.Tensor:
        """Delta of one variable, shaped as it, from every node's places ([N, 2]:
        Geometry.places) and C(val), added in node order."""
        total = tf.zeros([geometry.chunks, geometry.length], tf.float32)
        counts = tf.zeros_like(total)
        for placed, each in zip(places, values):
            total = tf.tensor_scatter_nd_add(total, placed, each)
            if self.options.average == "contributors":
                counts = tf.tensor_scatter_nd_add(counts, placed, tf.ones_like(each))
        if self.options.average == "contributors":
            mean = tf.math.divide_no_nan(total, counts)
        else:
            mean = total * F32(1.0 / self.num_towers)
        return geometry.unchunk(mean)
