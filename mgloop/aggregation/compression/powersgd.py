"""`powersgd:rank=r,warm_start=true,memory=residual`: rank-r gradients by one power iteration
(Vogels et al. 2019, "PowerSGD: practical low-rank gradient compression for distributed
optimization", Alg. 1 and 2), its factors P and Q summed by the ring all-reduce.

A variable of shape (..., m) is seen as the matrix M of shape n x m, n = prod(shape[:-1])
(a convolution kernel: its (kh kw in) x out matrix), and compressed at rank r' = min(r, n, m)
when it has 2 or more dimensions and the factors are small enough:
(n + m) r' min_compression < n m (PyTorch's PowerSGD hook's min_compression_rate;
min_compression=0 compresses every matrix). Vectors (biases, normalisation scales) and the
rest travel whole on the same ring, summed exactly as `ring` does. Per step, on tower t,
M_t = G_t + E_t (memory=residual, the paper's error feedback), with Q (m x r') the same on
every tower:

    P_t = M_t orth(Q)                     P = sum_t P_t       (ring all-reduce 1, with the vectors)
    P^ = orth(P)                          (every tower, on the same P: the same P^)
    Q_t = M_t^T P^                        Q' = sum_t Q_t      (ring all-reduce 2)
    out = (1/T) P^ Q'^T = P^ P^^T (1/T) sum_t M_t
    c_t = P^ Q_t^T = P^ P^^T M_t,  E_t <- M_t - c_t;  Q <- Q' / T (warm start, kept as state)

orth(A) is an orthonormal basis of A's columns: Householder QR's Q factor (tf.linalg.qr),
where the paper uses Gram-Schmidt; the two span the same space, and Householder stays
orthonormal to rounding when A is rank-deficient (a gradient of rank below r'). The paper
multiplies by Q itself; orth(Q) has the same column space, so P^ P^^T and out are the same
in exact arithmetic, while rounding no longer grows with Q's condition number (the warm
start's Q = M^T P^ is as ill-conditioned as the gradient). `warm_start=false` draws a fresh
Q each step from the shared seed (the same on every tower); the first Q of a warm start is
standard normal, seeded by --seed and the variable's index.

At full rank (r' = min(n, m)) and with min_compression=0 the method is lossless: P^ spans
the column space of the mean M (orth(Q) is square and orthogonal when r' = m; P^ is square
and orthogonal when r' = n), so out = mean M up to rounding: float32 relative error of a
few hundred u (u = 2^-24) per product and QR, far below a step's summation-order bound.
Bytes per tower and step: 2 (T-1)/T of (sum of n r' + the uncompressed sizes) and of
(sum of m r'), floats at --transport_dtype, in two ring all-reduces (two rounds of
messages per step for all variables together, not per variable).
Bound: memory=none: out is the projection of the mean onto span P^, ||out - mean|| <= G
(rho = 1); memory=residual: E_t = (I - P^ P^^T) M_t need not shrink (no bound: inf).
Across workers: refused: P^ must come from the P summed over every tower of the job
before Q is formed, which the local stage of cross_worker.py cannot give.
"""

from __future__ import annotations

import dataclasses
import math

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import option
from mgloop.aggregation.compression import scales
from mgloop.aggregation.compression.base import Compressed, CompressionOptions, memory_option
from mgloop.aggregation.compression.transport import SUMMABLE
from mgloop.aggregation.dense.ring import ring_all_reduce


def orthonormal(a: tf.Tensor) -> tf.Tensor:
    """An orthonormal basis of the columns of `a` (n x r, r <= n): Householder QR's Q."""
    return tf.linalg.qr(a).q


@dataclasses.dataclass(frozen=True)
class PowerSgdOptions(CompressionOptions):
    rank: int = option(2, "r, the rank of each compressed matrix (at most min(n, m))", low=1)
    warm_start: bool = option(True, "keep Q from the last step (false: a fresh seeded "
                                    "Gaussian Q every step)")
    min_compression: float = option(2.0, "compress an n x m matrix at rank r only when "
                                         "(n + m) r min_compression < n m; 0: every matrix",
                                    low=0.0)
    memory: str = memory_option("residual", "Vogels et al. 2019")


@dataclasses.dataclass(frozen=True)
class Matrix:
    """How one variable is compressed: as an n x m matrix at rank `rank`."""
    n: int
    m: int
    rank: int


def plan(shape, options: PowerSgdOptions) -> Matrix | None:
    """The matrix view of a variable of `shape`, or None: it travels whole."""
    if len(shape) < 2:
        return None
    n, m = math.prod(shape[:-1]), int(shape[-1])
    rank = min(options.rank, n, m)
    if (n + m) * rank * options.min_compression >= n * m:
        return None
    return Matrix(n, m, rank)


@register
class PowerSgd(Compressed):
    name = "powersgd"
    options_type = PowerSgdOptions
    capabilities = Compressed.capabilities.but(
        across_workers=False,
        buckets_payloads=False)  # P and Q of every variable already travel as one buffer each
    transport = SUMMABLE

    @classmethod
    def error_bound(cls, options, num_towers):
        if options.memory == "residual":
            return math.inf
        return 1.0 + scales.rounding(num_towers) * 2 * (1 + num_towers)

    def build(self, variables):
        self.plans = [plan(tuple(v.shape), self.options) for v in variables]
        super().build(variables)

    def extra_state(self, variable, index, tower):
        matrix = plan(tuple(variable.shape), self.options)
        if matrix is None or not self.options.warm_start:
            return {}
        return {"q": tf.random.stateless_normal([matrix.m, matrix.rank],
                                                seed=[self.seed, index], dtype=variable.dtype)}

    def start_q(self, site, matrix: Matrix) -> tf.Tensor:
        """orth(Q) of this step: of the kept Q, or of a fresh one from the shared seed."""
        if self.options.warm_start:
            q = site.state["q"].read_value()
        else:
            q = tf.random.stateless_normal([matrix.m, matrix.rank], seed=site.shared_seed,
                                           dtype=site.dtype)
        return orthonormal(q)

    def reduce(self, tower_values, variables, average=True):
        towers = list(self.devices.towers)
        count = len(variables)
        sites, xs, first = [], [], []
        for t, device in enumerate(towers):
            with tf.device(device):
                sites.append([self.site(t, i, tower_values[t][i]) for i in range(count)])
                xs.append([self.prepare(tf.reshape(tower_values[t][i], [-1]), sites[t][i])
                           for i in range(count)])
                first.append([
                    tf.reshape(tf.reshape(x, [p.n, p.m]) @ self.start_q(site, p), [-1])
                    if p else x for x, site, p in zip(xs[t], sites[t], self.plans)])
        first_sums = self._all_reduce(first, towers)
        p_hats, second = [], []
        for t, device in enumerate(towers):
            with tf.device(device):
                p_hats.append([orthonormal(tf.reshape(s, [p.n, p.rank])) if p else None
                               for s, p in zip(first_sums[t], self.plans)])
                second.append([  # Q_t, rounded as the wire will (c_t is formed from it)
                    self.wire_round((tf.reshape(tf.matmul(tf.reshape(x, [p.n, p.m]), p_hat,
                                                          transpose_a=True), [-1]),))[0]
                    if p else None for x, p_hat, p in zip(xs[t], p_hats[t], self.plans)])
        second_sums = self._all_reduce(second, towers)
        out = []
        for t, device in enumerate(towers):
            per_copy = []
            with tf.device(device):
                for i, p in enumerate(self.plans):
                    if p is None:
                        total = first_sums[t][i]
                    else:
                        total = self._product(p_hats[t][i], second_sums[t][i], p)
                        self._update(sites[t][i], xs[t][i],
                                     self._product(p_hats[t][i], second[t][i], p),
                                     second_sums[t][i], p)
                    per_copy.append(tf.reshape(self.scale(total, average),
                                               tuple(variables[i].shape)))
                self.steps[t].assign_add(1)
            out.append(per_copy)
        return out

    def _product(self, p_hat, q_flat, p: Matrix) -> tf.Tensor:
        """P^ Q^T, flat."""
        return tf.reshape(tf.matmul(p_hat, tf.reshape(q_flat, [p.m, p.rank]),
                                    transpose_b=True), [-1])

    def _update(self, site, x, sent, q_sum, p: Matrix) -> None:
        """E_t <- M_t - c_t (memory=residual); Q <- Q' / T (warm start)."""
        self.update_state(x, sent, site)
        if self.options.warm_start:
            site.state["q"].assign(tf.reshape(q_sum, [p.m, p.rank]) / self.num_towers)

    def _all_reduce(self, parts, towers) -> list[list]:
        """parts[t][i] (flat, or None where nothing travels) summed over towers on every
        tower by one ring all-reduce of their concatenation; None stays None."""
        present = [i for i, part in enumerate(parts[0]) if part is not None]
        if not present:
            return [list(per) for per in parts]
        sizes = [parts[0][i].shape.num_elements() for i in present]
        flats = []
        for t, device in enumerate(towers):
            with tf.device(device):
                flats.append(tf.concat([parts[t][i] for i in present], axis=0))
        out = []
        for t, total in enumerate(ring_all_reduce(self, flats, towers, average=False)):
            with tf.device(towers[t]):
                pieces = tf.split(total, sizes)
            per = [None] * len(parts[t])
            for i, piece in zip(present, pieces):
                per[i] = piece
            out.append(per)
        return out
