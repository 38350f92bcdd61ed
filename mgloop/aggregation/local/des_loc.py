"""`des_loc`: local Adam whose parameters and two moments meet, each on its own period.

DES-LOC (Iacob, Sani, Safaryan, Giampouras, Horvath, Jovanovic, Kurmanji, Aleksandrov,
Shen, Qiu and Lane 2025, "DES-LOC: Desynced Low Communication Adaptive Optimizers for
Training Foundation Models", arXiv 2505.22549, ICLR 2026). Inner steps as `localsgd`
(local_steps.py): T copies (one per node), copy c applying its own gradient g_c with its
own Adam, the run's --optimizer=adam (Keras's; with --weight_decay, AdamW's decoupled
decay): at the 0-based global step s (`step_counter`),

    m_c <- b1 m_c + (1 - b1) g_c          v_c <- b2 v_c + (1 - b2) g_c^2
    x_c <- x_c - a m_c / (sqrt(v_c) + eps),   a = lr sqrt(1 - b2^t_c) / (1 - b1^t_c)

(t_c the copy's own Adam step count, s + 1 unless its node was down)

and then, in `after_update`, each quantity q on its own period K_q,

    q = x (K_x = period), m (K_u = momentum_period), v (K_v = variance_period):
    if (s + 1) mod K_q == 0:   q_c <- (1/T) sum_c q_c   on every copy c

the sum formed by one ring all-reduce of q's values of every variable, flattened per
dtype (LocalSGD.ring_mean, ring.py: chunk k summed q_{k+T-1} + (... + (q_{k+1} + q_k))
on the chunk's devices in float32 and scaled by fl(1/T); every copy gets the same bits).
So the mean of one sync is within gamma(T-1) (1/T) sum_c |q_c| + u |mean| of the exact
mean, elementwise (u = 2^-24). x, m and v are synced in that order, each its own ring.
Adam's step counts are left alone. Defaults: K_x = 16,
K_u = 48 = 3 K_x, K_v = 96 = 6 K_x, the paper's recommendation for its K_x = 16 (the
moments' periods do not follow `period` when it alone is set).

Where mgloop stands to the paper. Its update at step t (as rendered from the paper):
the due states are replaced by their mean before the step's update, m_{t-1} when
t mod K_u = 0, v_{t-1} when t mod K_v = 0, x_t when t mod K_x = 0, then Adam with the
gradient taken at the node's own x_t. mgloop averages after step s = t - 1 when
(s + 1) mod K = 0: for m and v the same values enter every update (the mean of m_{t-1}
taken after step t - 1 or before step t is the same), and the nodes' mean of the
parameters moves by the mean of the nodes' updates in both; but the gradient of the step
after a parameter sync is taken at the mean (as `localsgd` takes it), the paper's at the
node's own x_t, so there a sync reaches the gradients one step later. The paper clips
each gradient (radius rho) first; --optimizer=adam does not clip (a user's Keras Adam may).

With every period 1 it is `localsgd:period=1,slots=average` (the same rings of the same
values; bit for bit where the rings sum in the same order: tests/test_des_loc.py), which
is not synchronous Adam: the mean of the nodes' Adam steps is not Adam's step of the mean
gradient (v averages g_c^2, not (mean g)^2), so it declares no `identity`.

Traffic: the sync of q moves 2 (T-1)/T of q's elements per copy through the ring, at q's
dtype (float32: 4 bytes each), recorded on its own occasion "parameters", "first moment",
"second moment" (traffic.py: the steps with (s + 1) mod K_q = 0), so a run's bytes per
step average 2 (T-1)/T n (1/K_x + 1/K_u + 1/K_v) elements (observe/link_report.py; n
the parameters), half of Local Adam's 3 n / K_x with the defaults: (1 + 1/3 + 1/6) / 3.

State: none of its own; the copies' checkpoint (`copies_differ`) holds every copy and
its Adam (m, v, step count). The model it produces (`global_model`): the nodes' mean
(1/N) sum_c x_c, as `localsgd`. A node joining an elastic resume takes node 0's copy with
node 0's m and v (`localsgd`'s rule: its moments were averaged at most K_u, K_v steps
ago, the paper's point that synced moments give a joining worker a state to start from).
Node failures (`live`): each ring among the live copies, a down copy takes nothing
(LocalSGD.if_live), as `localsgd` (placement/node_failures.py).
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import Options, option
from mgloop.aggregation.local.local_steps import LocalSGD, slot_variables
from mgloop.aggregation.traffic import Occasion, Sync
from mgloop.errors import ConfigError

# Each quantity: its occasion's name, its period's option, its Adam slots (None: parameters).
QUANTITIES = (("parameters", "period", None), ("first moment", "momentum_period", "momentums"),
              ("second moment", "variance_period", "velocities"))


@dataclasses.dataclass(frozen=True)
class DesLocOptions(Options):
    period: int = option(16, "K_x: steps between averagings of the parameters", low=1)
    momentum_period: int = option(48, "K_u: steps between averagings of Adam's first moment "
                                      "m (the paper recommends 3 K_x)", low=1)
    variance_period: int = option(96, "K_v: steps between averagings of Adam's second "
                                      "moment v (the paper recommends 6 K_x)", low=1)


@register
class DesLoc(LocalSGD):
    name = "des_loc"
    options_type = DesLocOptions
    capabilities = LocalSGD.capabilities.but(
        identity=None,  # every period 1 is localsgd:period=1,slots=average, not synchronous Adam
        needs_optimizer="adam",  # it averages Adam's first and second moments
        unsummable_reason="it exchanges no gradients")
    warmup = 0

    def occasions(self) -> list[Occasion]:
        """x's, m's and v's occasions: the steps s with (s + 1) mod K_q = 0."""
        return [Occasion(name, lambda step, k=getattr(self.options, period): (step + 1) % k == 0)
                for name, period, _ in QUANTITIES]

    def syncs(self) -> list[Sync]:
        """Three syncs: every parameter; Adam's m alone; Adam's v alone."""
        return [Sync(occasion, lambda o=occasion: o.occurs(self.step_counter),
                     variables=None if slots is None else (), slots=slots or False)
                for occasion, (_, _, slots) in zip(self.occasions(), QUANTITIES)]

    def due(self) -> tf.Tensor:
        """Whether the step now running syncs any of x, m, v."""
        return tf.reduce_any(tf.stack([sync.due() for sync in self.syncs()]))

    def after_update(self, copies):
        if self.num_towers == 1:
            return []
        for copy in copies:  # a user's own Keras optimizer (the API): validation saw no name
            inner = getattr(copy.optimizer, "inner_optimizer", copy.optimizer)
            if not isinstance(inner, keras.optimizers.Adam):
                raise ConfigError(f"--aggregation={self.name} averages Adam's moments: the "
                                  f"optimizer is {type(inner).__name__}; use --optimizer=adam")
        ops = []
        for sync in self.syncs():
            def run(sync=sync):
                with self.traffic.on(sync.occasion):
                    self.take_mean([list(c.trainable) if not sync.slots
                                    else slot_variables(c.optimizer, sync.slots)
                                    for c in copies])
                return tf.constant(True)
            with tf.control_dependencies(ops):  # one ring after the other, x, m, v
                ops.append(tf.cond(sync.due(), run, lambda: tf.constant(False)))
        return ops
