"""Numpy models of the quantisers and of PowerSGD, written from the papers, for one exchange.

Each takes the towers' values x[t] (gradient plus residual, float32 arrays of one variable)
and returns (out, sent): `out` is what every replica applies with mean semantics, (1/T) times
the combined value; `sent[t]` is tower t's decompressed contribution, so that its new
residual is x[t] - sent[t] (the error-feedback identity). Randomness enters as arguments
(`uniform[t]`, draws in [0, 1)), so a model is a plain function of its inputs; the methods
under test draw theirs from their own seeded streams and the tests hand the same draws here.
Arithmetic is float32, in the order the methods use, so that results can be compared
exactly where the method's own computation is exact (integer sums, signs, levels).
"""

from __future__ import annotations

import numpy as np


def stochastic_levels(x, scale, levels, uniform):
    """QSGD's xi (Alistarh et al. 2017, eq. 1) as integers: l_i in [-s, s] with
    l_i = sgn(x_i) (floor(a_i) + [u_i < a_i - floor(a_i)]), a_i = s |x_i| / scale,
    so that E[l_i] = s x_i / scale for |x_i| <= scale."""
    x = np.asarray(x, np.float32)
    a = np.abs(x) / np.float32(scale) * np.float32(levels)
    low = np.floor(a)
    return (np.sign(x) * (low + (np.asarray(uniform, np.float32) < a - low))).astype(np.int32)


def shared_scale_quantiser(xs, levels, uniform, norm, bucket=0, clip=0.0):
    """QSGD (norm=2) or TernGrad (norm=inf, levels=1) with scales shared by the towers: per
    bucket b of `bucket` consecutive entries (0: the whole tensor), M_b = max_t ||x_t on b||,
    l_t = stochastic_levels(x_t, M, s, u_t) with each entry's M_b; the integer levels are
    summed; out = (M / s) sum_t l_t / T; sent_t = (M / s) l_t. clip > 0: each x_t first
    limited to +-clip std(x_t) (TernGrad's gradient clipping)."""
    xs = [np.ravel(x).astype(np.float32) for x in xs]
    if clip > 0:
        xs = [np.clip(x, -np.float32(clip * x.std()), np.float32(clip * x.std())) for x in xs]
    n = xs[0].size
    size = n if bucket <= 0 else min(bucket, n)
    starts = range(0, n, size)
    scales = np.array([max(np.linalg.norm(x[i:i + size], norm) for x in xs) for i in starts],
                      np.float32)
    scale = np.repeat(scales, size)[:n]
    ls = [stochastic_levels(x, scale, levels, u) for x, u in zip(xs, uniform)]
    unit = scale / np.float32(levels)
    total = np.sum(ls, axis=0)
    out = unit * total.astype(np.float32) / np.float32(len(xs))
    return out, [unit * l.astype(np.float32) for l in ls], ls, scale


def onebit(xs):
    """1-bit SGD (Seide et al. 2014) with per-tensor reconstruction values: bit b_i = [x_i >= 0];
    tower t sends the bits and the means of its non-negative and of its negative entries
    (mu+, mu-); sent_t = mu+ where b, mu- elsewhere; out = (1/T) sum_t sent_t."""
    sent = []
    for x in xs:
        x = np.asarray(x, np.float32)
        bits = x >= 0
        up = x[bits].mean(dtype=np.float32) if bits.any() else np.float32(0)
        down = x[~bits].mean(dtype=np.float32) if (~bits).any() else np.float32(0)
        sent.append(np.where(bits, up, down).astype(np.float32))
    return np.mean(sent, axis=0, dtype=np.float64), sent


def scaled_sign(xs):
    """EF-signSGD's compressor (Karimireddy et al. 2019, Alg. 1): C(x) = (||x||_1 / d) sign(x);
    out = (1/T) sum_t C(x_t)."""
    sent = [np.float32(np.abs(x).sum(dtype=np.float64) / np.size(x)) * np.sign(x) for x in xs]
    return np.mean(sent, axis=0, dtype=np.float64), sent


def majority_vote(xs, scaled=True):
    """signSGD with majority vote (Bernstein et al. 2018, Alg. 3): vote = sign(sum_t sign(x_t));
    scaled: times the towers' mean of ||x_t||_1 / d (out = that * vote); sent_t as in
    `scaled_sign` (what tower t's residual is measured against)."""
    votes = np.sign(np.sum([np.sign(x).astype(np.int32) for x in xs], axis=0))
    sizes = [np.float32(np.abs(x).sum(dtype=np.float64) / np.size(x)) for x in xs]
    scale = np.mean(sizes, dtype=np.float64) if scaled else 1.0
    return scale * votes, [s * np.sign(x) for s, x in zip(sizes, xs)], votes


def matrix_shape(shape):
    """PowerSGD's matrix view of a tensor: (prod(shape[:-1]), shape[-1])."""
    return int(np.prod(shape[:-1])), int(shape[-1])


def orthonormal(a):
    """An orthonormal basis of the columns of `a` (n x r, r <= n): Householder QR's Q."""
    return np.linalg.qr(np.asarray(a, np.float64))[0]


def powersgd(ms, q):
    """One exchange of PowerSGD (Vogels et al. 2019, Alg. 1) on matrices ms[t] (n x m) with the
    shared Q (m x r): P = (1/T) sum_t M_t orth(Q); P^ = orth(P); Q' = (1/T) sum_t M_t^T P^;
    out = P^ Q'^T; sent_t = P^ P^^T M_t. Returns (out, sent, P^, Q') in float64.
    (orth(Q) in place of Q: the same column space, so the same P^ P^^T and out in exact
    arithmetic; the method orthonormalises Q so that rounding does not grow with cond(Q).)"""
    ms = [np.asarray(m, np.float64) for m in ms]
    basis = orthonormal(q)
    p = np.mean([m @ basis for m in ms], axis=0)
    p_hat = orthonormal(p)
    q_new = np.mean([m.T @ p_hat for m in ms], axis=0)
    sent = [p_hat @ (p_hat.T @ m) for m in ms]
    return p_hat @ q_new.T, sent, p_hat, q_new
