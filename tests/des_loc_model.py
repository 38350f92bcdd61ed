"""DES-LOC in numpy (mgloop/aggregation/local/des_loc.py's math): N nodes, each a Keras Adam,
x, m and v averaged over the live nodes on their own periods, with a first-order bound
on how far mgloop's float32 run may lie from this float64 model.

The bound (u = 2^-24; every quantity elementwise, E_q the bound on |mgloop's q - q|;
the gradients are given, so no error is fed back through them):

    m' = b1 m + (1-b1) g     E_m' = b1 E_m + 4u ((1-b1)(|g| + |m| + E_m) + |m'|)
    v' = b2 v + (1-b2) g^2   E_v' = b2 E_v + 4u ((1-b2)(g^2 + |v| + E_v) + |v'|)
                             (the difference, the product by fl(1-b), the sum: one
                             rounding each, and fl(1-b) itself)
    a_t = lr sqrt(1-b2^t) / (1-b1^t): relative error R_a = u (6 + (t+2) (b2^t/(1-b2^t)/2 +
                             b1^t/(1-b1^t))) (b as float32 and pow: (t+2)u of b^t, which
                             the subtraction 1 - b^t magnifies by b^t/(1-b^t); sqrt halves)
    q = m a / (sqrt(v) + eps)
        E_r = min(sqrt(E_v), E_v / (sqrt(v) + sqrt(max(v - E_v, 0))))   (|sqrt a - sqrt b|)
        E_d = E_r + 2u (sqrt(v) + E_r + eps),  d_min = max(sqrt(v) + eps - E_d, eps / 2)
        E_q = (a (E_m (1 + 2u) + |m| (R_a + 2u)) + |q| E_d) / d_min + u |q|
    x' = x - q               E_x' = E_x + E_q + u (|x'| + E_x + E_q)
    a sync of q over the live set L:
                             E = mean_L E_c + (|L| + 2) u mean_L (|q_c| + E_c)
                             (the ring's |L| - 1 additions, its scaling by fl(1/|L|))

first order in u; the test allows twice it (the second-order terms are below u^2 of the
same magnitudes). `mode` "des_loc" is the method; "local" keeps the moments local (only x
averaged, on period K_x), "reset" zeroes m, v and Adam's step count at every x sync (the
paper's two heuristics, for its toy problem).
"""

from __future__ import annotations

import numpy as np

U = 2.0 ** -24


class NumpyDesLoc:
    """`init`: the variables' initial values; x[i], m[i], v[i]: [N, *shape] float64."""

    def __init__(self, init, nodes, periods, lr, eps, b1=0.9, b2=0.999, mode="des_loc",
                 bound=True):
        self.x = [np.repeat(np.asarray(w, np.float64)[None], nodes, 0) for w in init]
        self.m = [np.zeros_like(w) for w in self.x]
        self.v = [np.zeros_like(w) for w in self.x]
        self.t = np.zeros(nodes)  # each node's Adam step count
        self.periods, self.lr, self.eps, self.b1, self.b2 = periods, lr, eps, b1, b2
        self.mode, self.nodes, self.bounded = mode, nodes, bound
        if bound:
            self.ex, self.em, self.ev = ([np.zeros_like(w) for w in self.x] for _ in range(3))

    def step(self, s, grads, live=None):
        """Step s: every live node applies grads[i][c] (float32 values), then the syncs."""
        live = np.ones(self.nodes, bool) if live is None else np.asarray(live, bool)
        b1, b2, eps = self.b1, self.b2, self.eps
        self.t[live] += 1
        tt = np.maximum(self.t, 1)  # (a down node's own a_t is not used)
        a_t = self.lr * np.sqrt(1 - b2 ** tt) / (1 - b1 ** tt)
        r_a = U * (6 + (tt + 2) * (b2 ** tt / (1 - b2 ** tt) / 2 + b1 ** tt / (1 - b1 ** tt)))
        for i, g in enumerate(grads):
            g = np.asarray(g, np.float64)
            x, m, v = self.x[i], self.m[i], self.v[i]
            per_node = (-1,) + (1,) * (x.ndim - 1)
            on, alpha, ra = live.reshape(per_node), a_t.reshape(per_node), r_a.reshape(per_node)
            m2 = np.where(on, b1 * m + (1 - b1) * g, m)
            v2 = np.where(on, b2 * v + (1 - b2) * g * g, v)
            q = m2 * alpha / (np.sqrt(v2) + eps)
            x2 = np.where(on, x - q, x)
            if self.bounded:
                em = np.where(on, b1 * self.em[i] + 4 * U * ((1 - b1) * (abs(g) + abs(m)
                              + self.em[i]) + abs(m2)), self.em[i])
                ev = np.where(on, b2 * self.ev[i] + 4 * U * ((1 - b2) * (g * g + abs(v)
                              + self.ev[i]) + abs(v2)), self.ev[i])
                r = np.sqrt(v2)
                er = np.minimum(np.sqrt(ev), ev / (r + np.sqrt(np.maximum(v2 - ev, 0)) + 1e-300))
                ed = er + 2 * U * (r + er + eps)
                dmin = np.maximum(r + eps - ed, eps / 2)
                eq = (alpha * (em * (1 + 2 * U) + abs(m2) * (ra + 2 * U)) + abs(q) * ed) / dmin \
                    + U * abs(q)
                ex = np.where(on, self.ex[i] + eq + U * (abs(x2) + self.ex[i] + eq), self.ex[i])
                self.em[i], self.ev[i], self.ex[i] = em, ev, ex
            self.x[i], self.m[i], self.v[i] = x2, m2, v2
        kx, ku, kv = self.periods
        if (s + 1) % kx == 0:
            self._average(self.x, "ex", live)
            if self.mode == "reset":
                for q in self.m + self.v:
                    q[live] = 0
                self.t[live] = 0
        if self.mode == "des_loc":
            if (s + 1) % ku == 0:
                self._average(self.m, "em", live)
            if (s + 1) % kv == 0:
                self._average(self.v, "ev", live)

    def _average(self, values, bound_name, live):
        count = int(live.sum())
        for i, q in enumerate(values):
            if self.bounded:
                e = getattr(self, bound_name)[i]
                mean_e = e[live].mean(0) + (count + 2) * U * (abs(q[live]) + e[live]).mean(0)
                e[live] = mean_e
            q[live] = q[live].mean(0)

    def take(self, node, source):
        """A returning node takes the source node's x, m, v and step count (and bounds)."""
        for values in (self.x, self.m, self.v) + ((self.ex, self.em, self.ev)
                                                  if self.bounded else ()):
            for q in values:
                q[node] = q[source]
        self.t[node] = self.t[source]


def rosenbrock_gradient(x):
    """The gradient of f(x1, x2) = (1 - x1)^2 + 100 (x2 - x1^2)^2, x: [..., 2]."""
    x1, x2 = x[..., 0], x[..., 1]
    return np.stack([-2 * (1 - x1) - 400 * x1 * (x2 - x1 ** 2), 200 * (x2 - x1 ** 2)], -1)


def rosenbrock(x):
    return (1 - x[..., 0]) ** 2 + 100 * (x[..., 1] - x[..., 0] ** 2) ** 2
