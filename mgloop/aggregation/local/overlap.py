"""When `streaming_diloco` uses a fragment's outer step: at once, tau steps later, or eagerly.

A fragment F is SENT after the step s that closes its period ((s + 1) mod H = o_p mod H,
streaming_diloco.py): each copy's outer gradient delta_c = x_c[F] - v_c[F] enters the
exchange then, recorded on the occasion "fragment p" of that step.

tau = 0 (the default): the outer step is applied in the same step, every copy takes the
new x[F] (v_c[F] <- x[F]): Streaming DiLoCo without overlap, bit for bit.

tau in 1..H-1 (overlap; Douillard et al. 2025, "Streaming DiLoCo with overlapping
communication", arXiv 2501.18512): the exchange runs while the copies take
tau more inner steps, and after step s + tau (`apply_occasion`) every copy MERGES:

    v_c[F] <- alpha v_c[F] + (1 - alpha) x[F]        (alpha = `alpha`, the paper's 0.5)

with v_c[F] the copy's parameters after those tau steps and x[F] the new outer parameters
(the outer SGD step on the exchanged mean, as at tau = 0). The outer step's inputs are all
known at the send step, so mgloop computes it there (the same operations on the same
values as on arrival) and holds the result in x, which nothing reads before the merge:
the in-flight result is x[F] (with m[F]), method state, checkpointed per node, so a run
resumed inside a flight merges the same bits. The next outer gradient of F is x[F] minus
the copy's parameters at F's next send (torchft keeps the same `original_parameters`).
tau < H is required: F's result must be merged before F is sent again (each fragment's
in-flight result lives in its own variables, so flights of different fragments may
overlap; torchft's `fragment_sync_delay` < H/P keeps one flight at a time because it
holds one pending all-reduce). Where mgloop differs from torchft's StreamingDiLoCo
(torchft/local_sgd.py, `fragment_update_alpha`, default 0 there): torchft's merge is
lerp(x, v, alpha) = x + alpha (v - x), the same mix in exact arithmetic, not the same
roundings; mgloop applies the merge only with tau > 0 (at tau = 0 there is no progress
to keep and the copy takes x, as `diloco`), and its send step is the period's close and
its merge tau steps later (torchft sends tau steps before and merges at the close).

eager = true (Kale et al. 2025, "Eager updates for overlapped communication and
computation in DiLoCo", arXiv 2502.12996): a one-outer-step overlap, the exchange of F's
outer gradients runs through F's whole next period (H steps), and the outer step at each
send uses, on copy c, its own fresh outer gradient in place of its share of the mean
that has not arrived, and the previous send's mean, now arrived, for the others':

    g_c = delta_c fl(1/T) + r_c           (the eager outer gradient)
    r_c <- mean_t - delta_c fl(1/T)       (mean_t = (1/T) sum_c' Q(delta_c'), this send's
                                          exchange; r_c: the others' share of it, used at
                                          F's next send; 0 before F's first send)

so g_c = (1/T) (delta_c(t) + sum_{c' != c} delta_c'(t-1)) in exact arithmetic (without
quantisation), and the outer SGD step is applied with g_c on x_c, m_c at once (tau = 0;
eager with tau > 0 is refused). x_c and m_c now differ per copy (each copy's own term),
and r_c is method state per copy (checkpointed per node). The own share is the copy's
float32 delta_c, not its code (a worker holds its own outer gradient exactly); mean_t
holds Q(delta_c), so with a quantised format r_c also carries (Q(delta_c) - delta_c)/T,
applied one period late.

Traffic: the send is recorded on F's occasion at the send step, whose `overlap_steps`
(traffic.py) say how many steps of compute it may hide behind: tau, or H when eager.
The link report (observe/link_report.py) charges such an exchange X only
max(0, X - k C) beyond the step's compute C, instead of max(C, X) - C.
"""

from __future__ import annotations

import tensorflow as tf

from mgloop.aggregation.traffic import Occasion


def apply_occasion(p: int, period: int, offset: int, tau: int) -> Occasion:
    """The steps that merge fragment p's result (tau > 0): s with s + 1 - tau >= o_p and
    (s + 1 - tau) mod H = o_p mod H, i.e. tau steps after each of its sends."""
    return Occasion(f"fragment {p} merge", lambda step: (step + 1 - tau >= offset)
                    & ((step + 1 - tau) % period == offset % period))


def merge(copies, starts, fragment: list[int], alpha: float) -> None:
    """v_c[F] <- alpha v_c[F] + (1 - alpha) x_c[F] on every copy (top)."""
    for copy, start in zip(copies, starts):
        with tf.device(copy.device):
            for i in fragment:
                target = copy.trainable[i]
                target.assign(alpha * target.read_value() + (1.0 - alpha) * start[i])


def eager_gradients(devices, deltas, means, pending, fragment: list[int], num: int):
    """g_c per copy (top) from the fresh `deltas` and the variables `pending` (r_c, updated
    to this send's). g_c = r_c + own is formed in the variable (assign_add) and read back,
    so that Grappler cannot merge it with the outer step's m + g into one AddN of three
    terms (which adds them in another order)."""
    out = []
    for c, device in enumerate(devices):
        with tf.device(device):
            gradients = []
            for d, mean, i in zip(deltas[c], means[c], fragment):
                own = d * (1.0 / num)
                pending[c][i].assign_add(own)
                gradients.append(pending[c][i].read_value())
                pending[c][i].assign(mean - own)
            out.append(gradients)
    return out
