"""`localsgd` and `diloco`: replicas that step alone and meet every H steps.

Replicated layout, T copies (one per tower), each with its own optimizer. Step s
(0-based; `step_counter`, the checkpointed global step) of copy c:

    v_c <- inner optimizer of copy c applied to g[c]     (tower c's own gradient;
                                                          no gradient exchange)

and then, in `after_update` (the step calls it every step), when the step closes a
period, i.e. s + 1 > W and (s + 1 - W) mod H == 0:

    localsgd   a = (1/T) sum_c v_c  (ring all-reduce, ring.py: every copy gets the
               same bits), v_c <- a for every copy.
    diloco     a as above; the outer gradient  delta = x - a  (x: the parameters every
               copy took at the last sync, `start`), and the outer SGD step
                   m <- mu m + delta
                   x <- x - lr_out (delta + mu m)   (nesterov)   or   x - lr_out m
               (PyTorch's SGD, which torchft's DiLoCo uses); v_c <- x for every copy.

`localsgd:warmup_steps=W` (post-local SGD, Lin et al. 2020, as PyTorch's
PostLocalSGDState / PeriodicModelAverager): for s < W the towers' gradients are
averaged by the ring every step (synchronous training), local steps begin after.

Optimizer slots at a sync: `slots=keep` (the default; PyTorch's model averagers and
PostLocalSGDOptimizer average parameters only, each replica keeps its momentum) or
`slots=average` (every float slot averaged too, as the momentum buffers in Yu, Jin and
Yang 2019, "On the linear speedup analysis of communication efficient momentum SGD").
The step counters of the optimizers are equal on every copy and left alone.
Non-trainable state (batch-norm statistics) is averaged every step, as for every
method (non_trainable.py: `averages_non_trainable`). DiLoCo
keeps each replica's inner optimizer state (Douillard et al. 2023, arXiv 2311.08105).

Identity: `localsgd:period=1` is synchronous training in exact arithmetic with a
linear optimizer (SGD, momentum: the mean of the copies' updates is the update of the
mean gradient), and so is `diloco:period=1,outer_lr=1,outer_momentum=0`
(x - (x - a) = a); in float32 they differ from it by the roundings of the mean of T
copies and, for DiLoCo, of the two subtractions.

Traffic: a sync moves 2(T-1)/T of the parameters per copy through the ring (DiLoCo's
outer step is computed on every copy from the same bits, so it moves nothing more); it
is recorded on the occasion "sync" (traffic.py: the steps s with s + 1 > W and
(s + 1 - W) mod H = 0), the warmup's gradient ring on the occasion "warmup" (s < W), so
a run's bytes per step average 1/H of a sync's after the warmup (observe/link_report.py).
The copies' checkpoint (`copies_differ`) holds this worker's replicas.

The model it produces (`global_model`, global_models.py): localsgd the nodes' mean
(1/N) sum_c v_c, diloco the outer parameters x (with one node the copy itself).

Node failures (`live`, set by between_nodes.py with `--node_failures`: copy c is node c): the ring
runs among the live copies only, a = (1/|L_s|) sum_{c in L_s} v_c (live_exchange.py), and
a down copy takes nothing from a sync (`if_live`): placement/node_failures.py states the rule.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from mgloop.aggregation import global_models, register
from mgloop.aggregation.base import REPLICATED, Aggregation, Options, option
from mgloop.aggregation.capabilities import Capabilities
from mgloop.aggregation.dense.ring import sharded_ring_all_reduce
from mgloop.aggregation.local.outer_schedule import (OuterMomentumOptions, momentum, warmup_ops,
                                                     warmup_steps)
from mgloop.aggregation.placement import live_exchange
from mgloop.aggregation.traffic import Occasion, Sync
from mgloop.training.variables import backing


def slot_variables(optimizer, which=True) -> list:
    """The optimizer's float slots (momenta, velocities): its variables but the step
    counter and the learning rate; `which` "momentums" or "velocities": Keras Adam's first
    or second moments alone (des_loc.py checks the optimizer is Adam)."""
    if which is not True:
        return list(getattr(getattr(optimizer, "inner_optimizer", optimizer), f"_{which}"))
    return [v for v in optimizer.variables if v.dtype in ("float16", "bfloat16", "float32",
                                                          "float64")
            and v.path.split("/")[-1] not in ("iteration", "learning_rate")]


@dataclasses.dataclass(frozen=True)
class LocalSGDOptions(Options):
    period: int = option(4, "H: steps between parameter averagings (1: every step)", low=1)
    warmup_steps: int = option(0, "W: synchronous steps (gradients averaged) before local "
                                  "steps begin (post-local SGD)", low=0)
    slots: str = option("keep", "optimizer slots at a sync: keep each replica's (PyTorch's "
                                "averagers) or average them too", choices=("keep", "average"))


@register
class LocalSGD(Aggregation):
    name = "localsgd"
    options_type = LocalSGDOptions
    capabilities = Capabilities(
        layout=REPLICATED, exact=False,  # local steps are by design not the synchronous update
        identity="period=1", summable=False,
        unsummable_reason="it exchanges no gradients after its warmup",
        across_workers=False,
        compressed_transport=False,  # parameters are averaged at their own dtype
        copies_differ=True,
        runs_between_processes=True)  # its transports reach other processes (peers.py)

    def __init__(self, devices, options=None, transport_dtype="float32", live=None,
                 **construction):
        super().__init__(devices, options, transport_dtype, **construction)
        self.live = live  # node_failures.Schedule: copy c is node c; syncs skip the down ones

    def parameter_devices(self):
        return list(self.devices.towers)

    @property
    def warmup(self) -> int:
        return self.options.warmup_steps

    def reduce(self, tower_values, variables, average=True):
        """Each copy's own gradient; during warmup (s < W), the ring's mean of them."""
        own = [list(values) for values in tower_values]
        if self.warmup == 0 or self.num_towers == 1:
            return own

        warmup = self.warmup_occasion()

        def warmup_mean():
            with self.traffic.on(warmup):
                return self.ring_mean(own, average)
        return tf.cond(warmup.occurs(self.step_counter), warmup_mean, lambda: own)

    # An occasion's rule is written once, for a Python int (what the report counts) and for
    # the step counter's tensor (what the step's tf.cond asks) alike: `&`, not `and`.
    def warmup_occasion(self) -> Occasion:
        """The steps of the warmup, s < W, on which the gradients go through the ring."""
        warmup = self.warmup
        return Occasion("warmup", lambda step: step < warmup)

    def sync_occasion(self) -> Occasion:
        """The steps that close a period (`due`): s + 1 > W and (s + 1 - W) mod H = 0."""
        warmup, period = self.warmup, self.options.period
        return Occasion("sync", lambda step: (step + 1 > warmup)
                        & ((step + 1 - warmup) % period == 0))

    def syncs(self) -> list[Sync]:
        """One sync of every parameter (and the slots with slots=average)."""
        return [Sync(self.sync_occasion(), self.due, slots=self.averages_slots)]

    @property
    def averages_slots(self) -> bool:
        """Whether a sync averages the optimizer's slots too (slots=average)."""
        return self.options.slots == "average"

    def due(self) -> tf.Tensor:
        """Whether the step now running closes a period (`sync_occasion`, on the counter)."""
        return self.sync_occasion().occurs(self.step_counter)

    def average(self, per_copy: list[list]) -> list[list[tf.Tensor]]:
        """(1/T) sum_c per_copy[c][i] of variables, on every copy's device (`ring_mean`)."""
        return self.ring_mean([[backing(v).read_value() for v in variables]
                               for variables in per_copy], True)

    def ring_mean(self, per_copy: list[list[tf.Tensor]], average: bool) -> list[list]:
        """(1/T) sum_c per_copy[c][i] (the sum if not `average`) for every i, on every
        copy's device: the values of each dtype flattened into one vector per copy, one
        ring all-reduce of it (ring.py: every copy gets the same bits), split back."""
        devices = list(self.devices.towers)
        out = [[None] * len(per_copy[0]) for _ in per_copy]
        for dtype in sorted({value.dtype.name for value in per_copy[0]}):
            indices = [i for i, x in enumerate(per_copy[0]) if x.dtype.name == dtype]
            shapes = [per_copy[0][i].shape for i in indices]
            flats = []
            for device, values in zip(devices, per_copy):
                with tf.device(device):
                    flats.append(tf.concat([tf.reshape(values[i], [-1]) for i in indices], 0))
            if self.live is not None:  # nodes fail: the ring among the live copies only
                means = live_exchange.ring_mean(self, flats, devices, average)
            else:
                means = sharded_ring_all_reduce(self, flats, devices, 1, average)
            for c, (device, mean) in enumerate(zip(devices, means)):
                with tf.device(device):
                    parts = tf.split(mean, [shape.num_elements() for shape in shapes])
                    for i, part, shape in zip(indices, parts, shapes):
                        out[c][i] = tf.reshape(part, shape)
        return out

    def synchronise(self, copies) -> None:
        """Every copy takes the mean of the copies' parameters (and slots, if asked)."""
        groups = [list(c.trainable) for c in copies]
        if self.averages_slots:
            groups = [g + slot_variables(c.optimizer) for g, c in zip(groups, copies)]
        self.take_mean(groups)

    def take_mean(self, groups: list[list]) -> None:
        """Copy c's variables groups[c] take the copies' mean (a down node's keep theirs)."""
        for c, (variables, means) in enumerate(zip(groups, self.average(groups))):
            for variable, mean in zip(map(backing, variables), means):
                with tf.device(variable.device):
                    variable.assign(self.if_live(c, mean, variable))

    def if_live(self, c: int, new, variable):
        """`new`, or the variable's own value while copy c's node is down (node failures)."""
        if self.live is None:
            return new
        return tf.where(self.live.alive(c, self.step_counter), new, tf.convert_to_tensor(variable))

    def copy_state(self, c: int) -> list:
        """The method's state of copy c alone (what a returning node takes: none here)."""
        return []

    def global_model(self, copies):
        """w = (1/N) sum_c v_c over the N copies it holds, on copy 0's device; between
        workers this node's own copy (global_models.py: no collective at evaluation)."""
        if self.peers is not None or len(copies) == 1:
            return super().global_model(copies)
        return global_models.mean_of([list(c.trainable) for c in copies], copies[0].device)

    def global_model_name(self) -> str:
        if self.peers is not None:
            return (f"node {self.peers.index}'s own copy (between workers the mean of the "
                    f"{self.num_towers} nodes' copies needs a collective; not built)")
        if self.num_towers == 1:
            return "copy 0 (one node)"
        return f"mean of the {self.num_towers} nodes' copies"

    def after_update(self, copies):
        if self.num_towers == 1:
            return []

        def sync():
            with self.traffic.on(self.sync_occasion()):
                self.synchronise(copies)
            return tf.constant(True)
        return [tf.cond(self.due(), sync, lambda: tf.constant(False))]


@dataclasses.dataclass(frozen=True)
class DiLoCoOptions(OuterMomentumOptions):
    period: int = option(16, "H: inner steps between outer steps", low=1)
    outer_lr: float = option(0.7, "the outer SGD's learning rate", low=0.0, low_open=True)
    outer_momentum: float = option(0.9, "the outer SGD's momentum mu", low=0.0, high=1.0,
                                   high_open=True)
    nesterov: bool = option(True, "Nesterov momentum in the outer SGD")


@register
class DiLoCo(LocalSGD):
    name = "diloco"
    options_type = DiLoCoOptions
    capabilities = LocalSGD.capabilities.but(identity="period=1,outer_lr=1,outer_momentum=0")
    averages_slots = False  # each replica keeps its inner optimizer's state

    @property
    def warmup(self) -> int:  # Pier's momentum warmup (outer_schedule.py; 0: none)
        return warmup_steps(self.options)

    def build(self, variables):
        """x (`start`, the parameters at the last sync) and the outer momentum m, one pair
        per copy on its device (as every DiLoCo worker holds the outer optimizer): x starts
        as the initial parameters, m at 0. Every copy computes the same outer step from
        the same bits, so the pairs stay equal and the sync moves only the ring's bytes."""
        self._start, self._momentum = [], []
        for c, device in enumerate(self.parameter_devices()):
            with tf.device(device):
                self._start.append([tf.Variable(v.read_value(), trainable=False,
                                                name=f"diloco_start_{c}/{v.name.split(':')[0]}")
                                    for v in variables])
                self._momentum.append([tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                                   name=f"diloco_momentum_{c}/"
                                                        f"{v.name.split(':')[0]}")
                                       for v in variables])

    @property
    def state_variables(self):
        return [v for pair in zip(self._start, self._momentum) for vs in pair for v in vs]

    def rejoined(self, copies) -> None:
        """A joining node's copies take x, the parameters of the last outer step (the same
        on every node), not node 0's inner progress since then, which node 0 brings to the
        next outer step itself; its inner optimizer state and the outer momentum stay node
        0's, as a recovering torchft DiLoCo replica loads a healthy peer's state dict."""
        for copy, starts in zip(copies, self._start):
            with tf.device(copy.device):
                for target, x in zip(copy.trainable, starts):
                    target.assign(tf.cast(x, target.dtype))

    def synchronise(self, copies) -> None:
        """The outer step on the mean a of the copies (every copy has the same bits of a, x
        and m), on every copy's device; every copy takes the new x."""
        means = self.average([list(c.trainable) for c in copies])
        lr, mu = self.options.outer_lr, momentum(self)  # outer_schedule.py: mu of this step
        for c, (copy, starts, momenta, averages) in enumerate(
                zip(copies, self._start, self._momentum, means)):
            with tf.device(copy.device):
                for target, x, m, a in zip(copy.trainable, starts, momenta, averages):
                    delta = x - a
                    m.assign(self.if_live(c, mu * m + delta, m))
                    step = delta + mu * m if self.options.nesterov else m.read_value()
                    x.assign(self.if_live(c, x - lr * step, x))
                    target.assign(self.if_live(c, x.read_value(), target))

    def copy_state(self, c: int) -> list:
        return self._start[c] + self._momentum[c]

    def after_update(self, copies):  # in Pier's warmup, m filled (outer_schedule.py)
        return super().after_update(copies) + warmup_ops(self, copies)

    outer_parameters_differ = False  # True: each copy's x_c its own (streaming's eager)

    def global_model(self, copies):
        """x, the outer parameters (copy 0's `start`, equal on every copy; where the copies'
        x_c differ, their mean, but between workers this node's own); with one node the
        copy itself (nothing is synced)."""
        if self.num_towers == 1:
            return Aggregation.global_model(self, copies)
        starts = self._start[0]
        if self.outer_parameters_differ and self.peers is None:
            starts = global_models.mean_of(self._start, copies[0].device)
        return [tf.cast(tf.convert_to_tensor(x), v.dtype)
                for x, v in zip(starts, copies[0].trainable)]

    def global_model_name(self) -> str:
        return "copy 0 (one node)" if self.num_towers == 1 else "outer parameters x"
