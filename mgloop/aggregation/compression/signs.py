"""`signsgd` (majority vote) and `efsignsgd` (scaled sign with error feedback).

Both send sign(x_t) (x flattened, n elements; sign(0) = 0) as integers in {-1, 0, 1}, one
byte each (int8; int16 past 127 towers), and one float32 scale s_t = ||x_t||_1 / n at
--transport_dtype. Tower t's own contribution, against which its residual is kept
(memory=residual: e_t <- x_t - c_t), is c_t = s_t sign(x_t) (Karimireddy et al.'s C(x)).

`signsgd:scaled=true,memory=none` — signSGD with majority vote (Bernstein et al. 2018,
"signSGD: compressed optimisation for non-convex problems", arXiv 1802.04434, Alg. 3): the
server returns the sign of the sum of the workers' signs. Transport: summable. The signs
and the scales each ride the ring all-reduce (ring.py; the integer sum is exact), and every
tower forms

    out = (1/T) (sum_t s_t) sign(sum_t sign(x_t))      (scaled=true)
    out = sign(sum_t sign(x_t))                        (scaled=false: the paper's update;
                                                        T times it with --grad_reduce=sum)

`scaled=true` gives the vote the towers' mean 1-norm per element, so the learning rate keeps
the meaning it has for the other methods; `scaled=false` sends no scale, and the learning
rate is the step per element (the paper's ~1e-4). The vote is not a mean of the towers'
values: it is this method's output by design, with the bound below. Bytes per tower and
variable: 2 (T-1)/T (n + 4) on the ring, or, when fewer, the 2-bit signs gathered:
(T-1) (ceil(n/4) + 4) (compression/base.py). Across workers: refused at the towers, as the
sign of a sum over all towers is not a sum of the workers' local votes (cross_worker.py adds
dense local results); between workers at the nodes it runs (one tower per worker).

Bound (scaled, memory=none): s_t sqrt(n) <= ||x_t||_2, so ||out|| <= mean_t ||x_t|| <= G
and ||out - mean|| <= 2 G. With memory=residual ||out|| <= G + E, E = q G / (1 - q) below:
2 + q / (1 - q). Unscaled: no bound relative to G (inf); refused with memory=residual (the
residual x - sign(x) would mix the gradient's units with the sign's).

`signsgd:bits=1` — one bit per sign (the one bit per coordinate signSGD's communication
is counted at): sign_1(x_i) = +1 if x_i > 0, -1 if x_i < 0, and for x_i = 0
(and -0.0, NaN) a fair coin r_i in {-1, +1} drawn from the tower's own stream
(stateless_uniform over {0, 1} at `site.tower_seed`: --seed, the exchange count, the
variable and the tower's global index, compression/base.py; so each tower, each step and
each variable draws afresh, and a resumed run draws the same). The signs travel packed 8
to a byte (bitpacking.pack_signs). A sum of T one-bit votes needs log2(T + 1) bits, so it
cannot ride the ring at one bit: the packed signs (and the scale) are always gathered
(`gathers_packed`) and every tower unpacks the T of them and adds them in tower order
(integers, exact), then forms the vote as above; an even T can tie (sum 0), which votes 0.
Bytes per tower and variable: (T-1) (ceil(n/8) + 4) ((T-1) ceil(n/8) with scaled=false).
`bits=2` (the default) is the ternary format above, unchanged. The bound is the same: the
scaled vote has ||out|| <= mean_t s_t sqrt(n) <= G, and with memory=residual
c_t = s_t sign_1(x_t) has sum_i x_i sign_1(x_i) = ||x_t||_1 and ||sign_1(x_t)||^2 = n, so
||x - c||^2 = ||x||^2 - ||x||_1^2 / n: the same q = sqrt(1 - 1/n).

`efsignsgd:memory=residual` — EF-signSGD (Karimireddy et al. 2019, "Error feedback fixes
SignSGD and other gradient compression schemes", Alg. 1): c_t = (||x_t||_1 / n) sign(x_t)
with x_t = g_t + e_t (their p_t with the learning rate outside: the same for a constant
one). Each tower's scale differs, so the transport is a gather (transport.py): every tower
receives the T-1 other (signs, scale), decodes them and adds the T contributions in tower
order: out = (1/T) sum_t c_t. Bytes per tower and variable: (T-1) (n + 4).
Bound: ||x - C(x)||^2 = ||x||^2 - ||x||_1^2 / n <= (1 - 1/n) ||x||^2 (their Lemma 8), so
q = sqrt(1 - 1/n): rho = q without memory, 2 q / (1 - q) with it (scales.contraction_bound).
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import option
from mgloop.aggregation.compression import scales
from mgloop.aggregation.compression.base import Compressed, CompressionOptions, memory_option
from mgloop.aggregation.compression.transport import GATHER, SUMMABLE
from mgloop.aggregation.kernels import bitpacking
from mgloop.errors import ConfigError


def sign_contraction(num_elements: int | None) -> float:
    """q = sqrt(1 - 1/n) of the scaled sign (1 when n is not given)."""
    return 1.0 if num_elements is None else math.sqrt(1.0 - 1.0 / num_elements)


class BoundForAnyLength:
    """A method whose bound grows with a variable's length n: `error_bound` (no n given)
    is `error_bound_for` at n unknown, the bound that holds for every n."""

    @classmethod
    def error_bound(cls, options, num_towers):
        return cls.error_bound_for(options, num_towers, None)


class SignContracted(BoundForAnyLength):
    """Error feedback around a compressor whose output is sign(x) times a scale: the
    contraction ||x - C(x)||^2 <= q ||x||^2 with q = sign_contraction(n) (Karimireddy et
    al. 2019), carried through the memory by scales.contraction_bound."""

    @classmethod
    def error_bound_for(cls, options, num_towers, num_elements):
        return scales.contraction_bound(sign_contraction(num_elements), options.memory,
                                        num_towers)


def signs_and_scale(x: tf.Tensor, num_towers: int) -> tuple:
    """(sign(x) as the integer type the ring sums, [||x||_1 / n] float32)."""
    size = tf.reduce_sum(tf.abs(x)) / tf.cast(tf.size(x), x.dtype)
    return tf.cast(tf.sign(x), scales.sum_dtype(num_towers, 1)), tf.reshape(size, [1])


def coin_signs(shape, seed: tf.Tensor) -> tf.Tensor:
    """int32 in {-1, +1} of `shape`: 2 b - 1, b stateless uniform over {0, 1} at `seed`."""
    bits = tf.random.stateless_uniform(shape, seed, minval=0, maxval=2,
                                       dtype=tf.int32)
    return 2 * bits - 1


def one_bit_signs(x: tf.Tensor, seed: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """sign_1(x) in `dtype`: +1 where x > 0, -1 where x < 0, a coin (`coin_signs`) elsewhere."""
    coins = coin_signs(tf.shape(x), seed)
    signs = tf.where(x > 0, tf.ones_like(coins), tf.where(x < 0, -tf.ones_like(coins), coins))
    return tf.cast(signs, dtype)


@dataclasses.dataclass(frozen=True)
class SignSgdOptions(CompressionOptions):
    scaled: bool = option(True, "multiply the vote by the towers' mean ||x_t||_1/n (false: "
                                "the paper's bare sign; pick a learning rate for it)")
    memory: str = memory_option("none", "Bernstein et al. 2018")
    bits: int = option(2, "bits per sign: 2, ternary (sign(0) = 0; on the ring or gathered, "
                          "whichever moves fewer bytes); 1, sign(0) a coin from the tower's "
                          "stream, packed 8 to a byte and always gathered", choices=(1, 2))


@dataclasses.dataclass(frozen=True)
class EfSignSgdOptions(CompressionOptions):
    memory: str = memory_option("residual", "Karimireddy et al. 2019")


@register
class SignSgd(BoundForAnyLength, Compressed):
    name = "signsgd"
    options_type = SignSgdOptions
    transport = SUMMABLE
    capabilities = Compressed.capabilities.but(across_workers=False)

    @classmethod
    def check(cls, request, options):
        if not options.scaled and options.memory == "residual":
            raise ConfigError("--aggregation=signsgd:scaled=false,memory=residual: the "
                              "residual x - sign(x) mixes units; use scaled=true or memory=none")

    @classmethod
    def error_bound_for(cls, options, num_towers, num_elements):
        if not options.scaled:
            return math.inf
        q = sign_contraction(num_elements) if options.memory == "residual" else 0.0
        carried = q / (1 - q) if q < 1 else math.inf
        return 2.0 + carried + scales.rounding(num_towers) * (2.0 + carried)

    def compress(self, x, site):
        signs, size = signs_and_scale(x, self.num_towers)
        if self.options.bits == 1:
            signs = one_bit_signs(x, site.tower_seed, signs.dtype)
        return (signs, size) if self.options.scaled else (signs,)

    def gathers_packed(self, encoded):
        """bits=1: always (a sum of one-bit votes does not fit one bit on the ring)."""
        return self.options.bits == 1 or super().gathers_packed(encoded)

    def pack(self, payload, site):
        """sign(x) in {-1, 0, +1} at 2 bits (ternary: sign(0) = 0 kept), or sign_1(x) in
        {-1, +1} at 1 bit (bits=1); the scale as is."""
        if self.options.bits == 1:
            return (bitpacking.pack_signs(payload[0]),) + tuple(payload[1:])
        return (bitpacking.pack_ternary(payload[0]),) + tuple(payload[1:])

    def unpack_rows(self, wires, site):
        dtype = scales.sum_dtype(self.num_towers, 1)
        rows = (bitpacking.unpack_signs_rows if self.options.bits == 1
                else bitpacking.unpack_ternary_rows)
        return (rows(wires[0], site.size, dtype),) + tuple(wires[1:])

    def decompress(self, payload, site):
        # own payload: s_t sign(x_t); the ring's sums: (sum_t s_t) sign(sum_t sign(x_t));
        # unscaled: T times the vote, so that the mean (the base's 1/T) is the vote itself
        vote = tf.sign(tf.cast(payload[0], site.dtype))
        return vote * (payload[1] if self.options.scaled else float(self.num_towers))


@register
class EfSignSgd(SignContracted, Compressed):
    name = "efsignsgd"
    options_type = EfSignSgdOptions
    transport = GATHER

    def compress(self, x, site):
        return signs_and_scale(x, 1)  # gathered, never summed: int8 holds a sign

    def pack(self, payload, site):
        """sign(x) in {-1, 0, +1} at 2 bits; the scale as is."""
        return bitpacking.pack_ternary(payload[0]), payload[1]

    def unpack_rows(self, wires, site):
        return bitpacking.unpack_ternary_rows(wires[0], site.size, tf.int8), wires[1]

    def decompress(self, payload, site):
        signs, size = payload
        return tf.cast(signs, site.dtype) * size

    def decompress_rows(self, payloads, site):
        signs, sizes = payloads
        return tf.cast(signs, site.dtype) * tf.reshape(sizes, [-1, 1])  # a size per row
