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
left alone), on every copy c, after the step that closes F's period (its SEND):

    float32 (outer_format=int, outer_bits=0)  a = (1/T) sum_c v_c[F] (`self.average`:
                     one ring all-reduce, ring.py, the fragment's values flattened),
                     delta = x[F] - a (bit for bit `diloco`'s, with fragments=1)
    quantised (outer_format=int with outer_bits = b in 2..8, or outer_format=e3m0)
                     delta_c = x[F] - v_c[F] per copy, quantised against the copies'
                     shared absmax and averaged: delta = (1/T) sum_c Q(delta_c)
                     (outer_formats.py: the formats, their error bounds, their bytes)
    m[F] <- mu m[F] + delta;   x[F] <- x[F] - lr (delta + mu m[F])  (Nesterov)
                                          or x[F] - lr m[F];   v_c[F] <- x[F].

The paper sends E3M0 4-bit floats and accumulates in float32 (outer_format=e3m0 here;
outer_bits is the integer format's alone). `tau` > 0 (overlap) applies the result tau
steps after its send, merged with the local progress made meanwhile by `alpha`;
`eager` (Kale et al. 2025, arXiv 2502.12996) applies at once an outer gradient whose own
share is the copy's fresh one and whose others' share arrives one period late: the
rules, where they differ from torchft and the paper, and their state in overlap.py.

Traffic: fragment p's exchange (the float ring, or the scales' ring and the codes' ring
or gather) is recorded on its own occasion "fragment p" (traffic.py: the steps with
(s + 1) mod H = o_p mod H), so a step moves at most one fragment's share and a run's
bytes per step average 1/H of `diloco`'s sync at outer_bits=0 (observe/link_report.py);
the peak is the largest fragment's share (about 1/P). With tau > 0 or eager the
occasion says the exchange may overlap tau (or H) steps of compute (`overlap_steps`).

The averaging goes through LocalSGD's ring helpers (`average`, `ring_mean`). One process,
as `diloco`. With one tower nothing is synced (as `diloco`). Between nodes (--nodes) the
method runs on the node leaders and `syncs()` (each fragment's step that changes its
variables: the send, or the merge tau steps later) tells between_nodes.py when to hand each
leader's copy of the fragment to its node's other towers.

State: x and m of every variable, one pair per copy on its device (`diloco`'s
`build`, its variable names too; checkpointed), and with eager the others' delayed share
r per copy; the fragments are a function of the variables' shapes and the options, so
nothing about them is saved.

Its model (`global_model`, global_models.py): x, each fragment as of its last outer step.
Identity: `period=1,fragments=1,outer_lr=1,outer_momentum=0,outer_bits=0` (tau=0, eager=false:
the defaults) is `diloco`'s identity, synchronous training in exact arithmetic (linear optimizer).
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from mgloop.aggregation import register
from mgloop.aggregation.base import option
from mgloop.aggregation.local import outer_formats, outer_schedule, overlap
from mgloop.aggregation.local.local_steps import DiLoCo, DiLoCoOptions
from mgloop.aggregation.traffic import Occasion, Sync
from mgloop.errors import ConfigError
from mgloop.training.variables import backing

BITS = (0, 2, 3, 4, 5, 6, 7, 8)


@dataclasses.dataclass(frozen=True)
class StreamingDiLoCoOptions(DiLoCoOptions):
    fragments: int = option(4, "P: contiguous groups of variables (balanced by element "
                               "count), each synced every H steps, staggered by H/P", low=1)
    outer_format: str = option("int", "how outer gradients travel: int (float32 with "
                                      "outer_bits=0, else uniform integers of outer_bits) or "
                                      "e3m0 (4-bit floats: sign and 3 exponent bits, "
                                      "gathered)", choices=outer_formats.FORMATS)
    outer_bits: int = option(0, "outer_format=int: outer gradients quantised to b bits "
                                "(per-fragment absmax, uniform, round to nearest) before "
                                "averaging; 0: float32", choices=BITS)
    tau: int = option(0, "overlap: a fragment's outer step is merged tau inner steps after "
                         "its send (0: in the step that sends it); tau < period", low=0)
    alpha: float = option(0.5, "with tau > 0, the merge: alpha x local + (1 - alpha) x "
                               "the new outer parameters", low=0.0, high=1.0)
    eager: bool = option(False, "eager updates: the outer step at a send uses the copy's "
                                "own fresh outer gradient and the others' of the previous "
                                "send (one-period overlap)")


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
    capabilities = DiLoCo.capabilities.but(
        identity="period=1,fragments=1,outer_lr=1,outer_momentum=0,outer_bits=0")

    @classmethod
    def check(cls, request, options):
        spec = f"--aggregation={cls.name}:period={options.period}"
        if options.fragments > options.period:
            raise ConfigError(
                f"{spec},fragments={options.fragments}: fragments must be <= period (each "
                f"fragment syncs at its own step of the period, offsets floor((p+1)H/P))")
        if options.tau >= options.period:
            raise ConfigError(f"{spec},tau={options.tau}: tau must be < period (a fragment's "
                              f"outer step is merged before the fragment is sent again)")
        if options.eager and options.tau:
            raise ConfigError(f"--aggregation={cls.name}:eager=true,tau={options.tau}: eager "
                              f"updates overlap a whole period themselves; use tau=0 with "
                              f"eager=true")
        if options.outer_format == "e3m0" and options.outer_bits:
            raise ConfigError(f"--aggregation={cls.name}:outer_format=e3m0,outer_bits="
                              f"{options.outer_bits}: outer_bits sets the int format only "
                              f"(e3m0 has 4 bits); use outer_bits=0 with outer_format=e3m0")

    @property
    def quantised(self) -> bool:
        return self.options.outer_format == "e3m0" or self.options.outer_bits > 0

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
        """`diloco`'s x and m per copy (and with eager r per copy, float32 zeros), and the
        fragments (variable indices) of `variables` (which `check_model` has checked)."""
        super().build(variables)
        self.sizes = [v.shape.num_elements() for v in variables]
        self.fragments = partition(self.sizes, self.options.fragments)
        self.offsets = offsets(self.options.period, self.options.fragments)
        self._pending = []
        if self.options.eager:
            for c, device in enumerate(self.parameter_devices()):
                with tf.device(device):
                    self._pending.append([tf.Variable(
                        tf.zeros(v.shape, tf.float32), trainable=False,
                        name=f"streaming_diloco_pending_{c}/{v.name.split(':')[0]}")
                        for v in variables])

    @property
    def state_variables(self):
        return super().state_variables + [v for vs in self._pending for v in vs]

    def __init__(self, *args, **construction):
        super().__init__(*args, **construction)
        if self.options.eager:  # a resize cannot re-deal what is in flight
            self.capabilities = self.capabilities.but(resize_refusal="eager's delayed shares "
                "r are each node's own part of a round in flight, with no rule to re-deal them")

    @property
    def outer_parameters_differ(self) -> bool:
        return self.options.eager  # (`diloco`'s global_model: then the mean of the x_c)

    def global_model_name(self) -> str:
        if self.num_towers == 1 or not self.options.eager:
            return super().global_model_name() + (" (each fragment as of its last outer step)"
                                                  if self.num_towers > 1 else "")
        return (f"node {self.peers.index}'s own outer parameters x_c (eager: the mean needs a "
                "collective between workers; not built)" if self.peers is not None else
                f"mean of the {self.num_towers} nodes' outer parameters x_c (eager)")

    def fragment_occasions(self) -> list[Occasion]:
        """One occasion per fragment p ("fragment p"): the steps s with
        (s + 1) mod H = o_p mod H (`fragment_due`), its exchange overlapping tau (eager:
        H) steps of compute."""
        period, warmup = self.options.period, self.warmup  # none in Pier's warmup
        hidden = period if self.options.eager else self.options.tau
        return [Occasion(f"fragment {p}", lambda step, o=offset: (step + 1 > warmup) & (
            (step + 1) % period == o % period), hidden) for p, offset in enumerate(self.offsets)]

    def change_occasions(self) -> list[Occasion]:
        """Per fragment, the steps that change its variables: its sends, or with tau > 0
        its merges (overlap.py)."""
        if not self.options.tau:
            return self.fragment_occasions()
        return [overlap.apply_occasion(p, self.options.period, offset, self.options.tau)
                for p, offset in enumerate(self.offsets)]

    def syncs(self) -> list[Sync]:
        """One sync per fragment, of its variables only, on the steps that change them."""
        return [Sync(occasion, lambda o=occasion: o.occurs(self.step_counter), tuple(fragment))
                for occasion, fragment in zip(self.change_occasions(), self.fragments)]

    def fragment_due(self, p: int) -> tf.Tensor:
        """Whether the step now running closes fragment p's period (its occasion's rule, on
        the step counter): its send."""
        return self.fragment_occasions()[p].occurs(self.step_counter)

    def due(self) -> tf.Tensor:
        """Whether the step now running changes any fragment's variables (LocalSGD's hook)."""
        return tf.reduce_any(tf.stack([sync.due() for sync in self.syncs()]))

    def after_update(self, copies):
        if self.num_towers == 1:
            return []
        ops = []
        for p, (fragment, occasion) in enumerate(zip(self.fragments, self.fragment_occasions())):
            def send(fragment=fragment, occasion=occasion):
                with self.traffic.on(occasion):
                    self.synchronise_fragment(copies, fragment)
                return tf.constant(True)
            ops.append(tf.cond(self.fragment_due(p), send, lambda: tf.constant(False)))
        if self.options.tau:
            for fragment, sync in zip(self.fragments, self.syncs()):
                def merge(fragment=fragment):
                    overlap.merge(copies, self._start, fragment, self.options.alpha)
                    return tf.constant(True)
                ops.append(tf.cond(sync.due(), merge, lambda: tf.constant(False)))
        return ops + outer_schedule.warmup_ops(self, copies)  # Pier's warmup: m filled

    def synchronise_fragment(self, copies, fragment: list[int]) -> None:
        """The outer step of the variables `fragment` (indices) on every copy (top); every
        copy takes the new x at once unless tau > 0 (then at the merge, overlap.py)."""
        if self.quantised or self.options.eager:
            deltas = self.outer_gradients(copies, fragment)
        else:
            means = self.average([[c.trainable[i] for i in fragment] for c in copies])
            deltas = None
        lr, mu = self.options.outer_lr, outer_schedule.momentum(self)
        for c, copy in enumerate(copies):
            with tf.device(copy.device):
                for k, i in enumerate(fragment):
                    target, x, m = copy.trainable[i], self._start[c][i], self._momentum[c][i]
                    delta = x - means[c][k] if deltas is None else deltas[c][k]
                    m.assign(mu * m + delta)
                    step = delta + mu * m if self.options.nesterov else m.read_value()
                    x.assign(x - lr * step)
                    if not self.options.tau:
                        target.assign(x.read_value())

    def local_deltas(self, copies, fragment: list[int]) -> list[list[tf.Tensor]]:
        """delta_c = x_c - v_c of the fragment's variables, float32, on every copy."""
        out = []
        for c, copy in enumerate(copies):
            with tf.device(copy.device):
                out.append([tf.cast(self._start[c][i] - backing(copy.trainable[i]).read_value(),
                                    tf.float32) for i in fragment])
        return out

    def mean_delta(self, deltas: list[list[tf.Tensor]]) -> list[list[tf.Tensor]]:
        """(1/T) sum_c Q(delta_c) in the run's format (outer_formats.py; float32: the
        ring's mean), float32, on every copy."""
        if self.options.outer_format == "e3m0":
            return outer_formats.e3m0_mean(self, deltas)
        if self.options.outer_bits:
            return outer_formats.int_mean(self, deltas, self.options.outer_bits)
        return self.ring_mean(deltas, True)

    def outer_gradients(self, copies, fragment: list[int]) -> list[list[tf.Tensor]]:
        """The outer gradient each copy applies: the format's mean, or eager's g_c
        (overlap.py), cast to the variables' dtype."""
        deltas = self.local_deltas(copies, fragment)
        means = self.mean_delta(deltas)
        if self.options.eager:
            means = overlap.eager_gradients(list(self.devices.towers), deltas, means,
                                            self._pending, fragment, self.num_towers)
        out = []
        for c, copy in enumerate(copies):
            with tf.device(copy.device):
                out.append([tf.cast(g, self._start[c][i].dtype)
                            for g, i in zip(means[c], fragment)])
        return out
