"""`streaming_diloco`: DiLoCo whose outer step runs on one fragment of the parameters at a time.

Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping
communication", arXiv 2501.18512). Inner steps as `diloco` (local_steps.py): T copies,
one per tower, each applying its own tower's gradient with its own optimizer; no
gradient exchange.

Fragments. The trainable variables, in variable order, are cut into P = `fragments`
contiguous non-empty groups (`partition`): C* is the smallest largest-group element
count over all such cuts, and the groups are filled greedily in variable order up to
C* elements, a group being closed early only when as many variables remain as groups
are still to open (those then take one variable each). The paper's main runs take
layers strided over the fragments (layer i in fragment i mod P); here they are
contiguous.

Schedule. Every fragment has the outer period H = `period`, staggered: fragment p
(0-based) syncs after the step s (0-based global step, `step_counter`) with

    (s + 1) mod H == o_p mod H,     o_p = floor((p + 1) H / P)

so every fragment syncs once every H steps, fragment p first after step o_p - 1, the
last fragment (o_{P-1} = H) as `diloco` does; the o_p are distinct (P <= H is
required), so at most one fragment syncs per step, and when P divides H they are H/P
apart. A fragment's first outer gradient covers its first o_p steps.

Outer step of fragment F (only its variables; the other variables of every copy are
left alone), on every copy c with the same bits of a, x and m:

    outer_bits = 0   a = (1/T) sum_c v_c[F]   (`self.average`: one ring all-reduce,
                     ring.py, the fragment's values flattened), delta = x[F] - a
                     (bit for bit `diloco`'s, with fragments=1)
    outer_bits = b   delta_c = x[F] - v_c[F] per copy, quantised (below) and averaged:
                     delta = (1/T) sum_c Q(delta_c)
    m[F] <- mu m[F] + delta;   x[F] <- x[F] - lr (delta + mu m[F])  (Nesterov)
                                          or x[F] - lr m[F];   v_c[F] <- x[F].

Quantisation (`outer_bits` = b in 2..8; 0: off, float32). NOT the paper's format: the
paper sends each outer gradient as a 4-bit float (E3M0: sign and 3 exponent bits, no
mantissa) and accumulates in float32. Here: per-fragment absmax, uniform, symmetric,
round to nearest (half to even), with L = 2^(b-1) - 1 levels each side (b = 4: the
integers -7..7) and one scale shared by the copies:

    A = max_c max_{i in F} |delta_c,i|    (each copy's absmax put in its slot of a
                                          length-T vector, summed by the ring: every
                                          copy gets all T exactly and takes the max)
    s = A * fl(1/L);  q_c = clip(round(delta_c / s), -L, L) (0 where s = 0), an integer
    delta = float32(sum_c q_c) * (s * fl(1/T))   (the integer codes summed by the ring,
                                                  exact and independent of the order)

so |delta - (1/T) sum_c delta_c| <= s/2 = A / (2L) per element, up to float32's own
roundings (fl(1/L), fl(1/T): float32 constants, multiplied by rather than divided by,
as TensorFlow's graph optimiser would rewrite a division by a constant). The codes
travel as the ring's partial sums in the narrowest signed integer type holding T L
(compression/scales.py's `sum_dtype`: int8 up to T L = 127), not
packed at b bits: a ring sums as it goes, and sums of T codes need more than b bits.

Traffic: fragment p's ring (with quantisation the int codes' ring plus a ring of T
float32 scales) is recorded on its own occasion "fragment p" (traffic.py: the steps with
(s + 1) mod H = o_p mod H), so a step moves at most one fragment's share and a run's
bytes per step average 1/H of `diloco`'s sync at outer_bits=0 (observe/link_report.py);
the peak is the largest fragment's share (about 1/P).

Not modelled: the overlap of the paper (a fragment's synced values applied tau inner
steps after its exchange starts, merged with the local progress meanwhile): here a
fragment is exchanged and applied in the step that closes its period (tau = 0). The
averaging goes through LocalSGD's ring helpers (`average`, `ring_mean`). One process,
as `diloco`. With one tower nothing is synced (as `diloco`). Between nodes (--nodes) the
method runs on the node leaders and `due` (any fragment's sync) tells nodes.py when to
hand each leader's copy to its node's other towers.

State: x and m of every variable, one pair per copy on its device (`diloco`'s
`build`, its variable names too; checkpointed); the fragments are a function of the
variables' shapes and the options, so nothing about them is saved.

Identity: `period=1,fragments=1,outer_lr=1,outer_momentum=0,outer_bits=0` is
`diloco:period=1,outer_lr=1,outer_momentum=0`, i.e. synchronous training in exact
arithmetic with a linear inner optimizer.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import option
from mgloop.aggregation.compression.scales import sum_dtype
from mgloop.aggregation.local_steps import DiLoCo, DiLoCoOptions
from mgloop.aggregation.traffic import Occasion, Sync
from mgloop.errors import ConfigError
from mgloop.spec.variables import backing

BITS = (0, 2, 3, 4, 5, 6, 7, 8)


@dataclasses.dataclass(frozen=True)
class StreamingDiLoCoOptions(DiLoCoOptions):
    fragments: int = option(4, "P: contiguous groups of variables (balanced by element "
                               "count), each synced every H steps, staggered by H/P", low=1)
    outer_bits: int = option(0, "outer gradients quantised to b bits (per-fragment absmax, "
                                "uniform, round to nearest) before averaging; 0: float32",
                             choices=BITS)


def offsets(period: int, fragments: int) -> list[int]:
    """o_p = floor((p + 1) H / P), p = 0..P-1: fragment p syncs when (s + 1) mod H == o_p mod H."""
    return [(p + 1) * period // fragments for p in range(fragments)]


def partition(sizes: list[int], fragments: int) -> list[list[int]]:
    """Variable indices of each of P contiguous non-empty groups (see the module's top):
    the smallest feasible largest-group size C*, then groups filled greedily up to it."""
    if fragments > len(sizes):
        raise ValueError(f"{fragments} fragments of {len(sizes)} variables")

    def groups_needed(capacity):
        count, filled = 1, 0
        for n in sizes:
            if filled and filled + n > capacity:
                count, filled = count + 1, 0
            filled += n
        return count

    low, high = max(sizes), sum(sizes)
    while low < high:  # the smallest capacity that P (or fewer) groups can meet
        middle = (low + high) // 2
        low, high = (low, middle) if groups_needed(middle) <= fragments else (middle + 1, high)
    out, filled = [[]], 0
    for i, n in enumerate(sizes):
        remaining, to_open = len(sizes) - i, fragments - len(out)
        if out[-1] and (filled + n > low or remaining == to_open):
            out.append([])
            filled = 0
        out[-1].append(i)
        filled += n
    assert len(out) == fragments, (sizes, fragments, out)
    return out


@register
class StreamingDiLoCo(DiLoCo):
    name = "streaming_diloco"
    options_type = StreamingDiLoCoOptions
    identity = "period=1,fragments=1,outer_lr=1,outer_momentum=0,outer_bits=0"

    @classmethod
    def check(cls, request, options):
        if options.fragments > options.period:
            raise ConfigError(
                f"--aggregation={cls.name}:period={options.period},fragments="
                f"{options.fragments}: fragments must be <= period (each fragment syncs at its "
                f"own step of the period, offsets floor((p+1)H/P))")

    @property
    def levels(self) -> int:
        """L = 2^(b-1) - 1: the codes are the integers -L..L."""
        return 2 ** (self.options.outer_bits - 1) - 1

    def check_model(self, variables):
        """Refuses more fragments than trainable variables (a fragment is a set of whole
        variables), in one line, once the template model is built and before its copies."""
        super().check_model(variables)
        count, fragments = len(variables), self.options.fragments
        if fragments > count:
            raise ConfigError(
                f"--aggregation={self.name}:fragments={fragments} needs at least {fragments} "
                f"trainable variables (a fragment holds whole variables); the model has "
                f"{count}: use fragments <= {count}")

    def build(self, variables):
        """`diloco`'s x and m per copy, and the fragments (variable indices) of `variables`
        (which `check_model` has checked)."""
        super().build(variables)
        self.sizes = [v.shape.num_elements() for v in variables]
        self.fragments = partition(self.sizes, self.options.fragments)
        self.offsets = offsets(self.options.period, self.options.fragments)

    def fragment_occasions(self) -> list[Occasion]:
        """One occasion per fragment p ("fragment p"): the steps s with
        (s + 1) mod H = o_p mod H (`fragment_due`)."""
        period = self.options.period
        return [Occasion(f"fragment {p}", lambda step, o=offset: (step + 1) % period == o % period)
                for p, offset in enumerate(self.offsets)]

    def syncs(self) -> list[Sync]:
        """One sync per fragment, of its variables only."""
        return [Sync(occasion, lambda p=p: self.fragment_due(p), tuple(fragment))
                for p, (occasion, fragment) in enumerate(zip(self.fragment_occasions(),
                                                             self.fragments))]

    def fragment_due(self, p: int) -> tf.Tensor:
        """Whether the step now running closes fragment p's period (its occasion's rule, on
        the step counter)."""
        return self.fragment_occasions()[p].occurs(self.step_counter)

    def due(self) -> tf.Tensor:
        """Whether the step now running closes any fragment's period (LocalSGD's hook,
        read by nodes.py to hand a node leader's parameters to its other towers)."""
        return tf.reduce_any(tf.stack([self.fragment_due(p) for p in range(len(self.fragments))]))

    def after_update(self, copies):
        if self.num_towers == 1:
            return []
        ops = []
        occasions = self.fragment_occasions()
        for p, fragment in enumerate(self.fragments):
            def sync(fragment=fragment, occasion=occasions[p]):
                with self.traffic.on(occasion):
                    self.synchronise_fragment(copies, fragment)
                return tf.constant(True)
            ops.append(tf.cond(self.fragment_due(p), sync, lambda: tf.constant(False)))
        return ops

    def synchronise_fragment(self, copies, fragment: list[int]) -> None:
        """The outer step of the variables `fragment` (indices) on every copy (top)."""
        if self.options.outer_bits:
            deltas = self.quantised_mean_delta(copies, fragment)
        else:
            means = self.average([[c.trainable[i] for i in fragment] for c in copies])
            deltas = None
        lr, mu = self.options.outer_lr, self.options.outer_momentum
        for c, copy in enumerate(copies):
            with tf.device(copy.device):
                for k, i in enumerate(fragment):
                    target, x, m = copy.trainable[i], self._start[c][i], self._momentum[c][i]
                    delta = x - means[c][k] if deltas is None else deltas[c][k]
                    m.assign(mu * m + delta)
                    step = delta + mu * m if self.options.nesterov else m.read_value()
                    x.assign(x - lr * step)
                    target.assign(x.read_value())

    def quantised_mean_delta(self, copies, fragment: list[int]) -> list[list[tf.Tensor]]:
        """(1/T) sum_c Q(x - v_c) of the fragment's variables, on every copy (top)."""
        num, levels = self.num_towers, self.levels
        first = getattr(self, "tower_offset", 0)  # this process's copy 0 among all T
        deltas, peaks = [], []
        for c, copy in enumerate(copies):
            with tf.device(copy.device):
                mine = [tf.cast(self._start[c][i] - backing(copy.trainable[i]).read_value(),
                                tf.float32) for i in fragment]
                deltas.append(mine)
                peak = tf.reduce_max(tf.stack([tf.reduce_max(tf.abs(d)) for d in mine]))
                peaks.append([tf.tensor_scatter_nd_update(tf.zeros([num]), [[first + c]],
                                                            [peak])])
        gathered = self.ring_mean(peaks, average=False)  # every copy's absmax, exactly
        codes_dtype = sum_dtype(num, levels)
        codes, scales = [], []
        for c, copy in enumerate(copies):
            with tf.device(copy.device):
                scale = tf.reduce_max(gathered[c][0]) * (1.0 / levels)
                scales.append(scale)
                codes.append([tf.cast(tf.clip_by_value(
                    tf.round(tf.math.divide_no_nan(d, scale)), -levels, levels), codes_dtype)
                    for d in deltas[c]])
        totals = self.ring_mean(codes, average=False)  # integer sums: exact, any order
        out = []
        for c, copy in enumerate(copies):
            with tf.device(copy.device):
                out.append([tf.cast(tf.cast(total, tf.float32) * (scales[c] * (1.0 / num)),
                                    self._start[c][i].dtype)
                            for total, i in zip(totals[c], fragment)])
        return out
