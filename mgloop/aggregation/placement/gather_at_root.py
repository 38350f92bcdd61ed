"""The transport of the methods that need every tower's whole gradient (`GatherAtRoot`).

Robust aggregators (median.py, trimmed_mean.py, krum.py, bulyan.py, geomedian.py,
centered_clipping.py) and Adasum (adasum.py) are not sums of the towers' values: they
compare whole tensors (or the whole gradient vector). They gather and broadcast, the
trusted-server model of the Byzantine literature (Blanchard et al. 2017):

    tower t != 0 sends g[t][v] to tower 0          (send: --transport_dtype, counted)
    tower 0 mixes them if nnm > 0: g[t] -> y[t]     (`mix`, nnm.py; robust methods)
    tower 0 computes out[v] = A(y[0], ..., y[T-1])[v]    (the method's `combine`)
    tower 0 sends out[v] to every other tower      (one tensor, so replicas stay identical;
                                                   once per device with several towers
                                                   on one: device_groups.py)

so every replica applies the same bits. Bytes per step for P bytes of gradients: tower 0
receives and sends (T-1) P, every other tower sends P and receives P (as
reduce_broadcast.py). `combine` sees tower 0's copy of every tower's value, stacked in
tower order, and is computed once there.

Mean semantics: A estimates the mean gradient (1/T) sum_t g[t] (it equals it for T
identical gradients; centered clipping only once they are within tau of its centre);
with average=False (--grad_reduce=sum) the result is T * A, the sum that estimate
stands for. Not summable (no element-wise sum to ride a ring), not
across workers at the towers (the estimate needs every worker's towers' whole gradients in
one place); between workers at the nodes every worker gathers every node's gradient and
combines them itself (`_reduce_between_workers`).

Nearest-neighbour mixing (nnm.py) is an option of every robust method here, `nnm=f`
(0: off), one field of the shared `RobustOptions` their options subclass; `check`
refuses T <= 2 nnm and `mix` applies it to the gathered stack before `combine`, in
`reduce` and `_reduce_between_workers` alike, so a method's `combine` never sees it.
"""

from __future__ import annotations

import abc
import dataclasses

import tensorflow as tf

from mgloop.aggregation.base import REPLICATED, Aggregation, Options, option
from mgloop.aggregation.capabilities import Capabilities
from mgloop.aggregation.compression.transport import ring_all_gather
from mgloop.aggregation.kernels import stacked_rows
from mgloop.aggregation.robust import nnm as nnm_lib
from mgloop.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RobustOptions(Options):
    """The options every robust gathering method takes (its options subclass this)."""
    nnm: int = option(0, "f of nearest-neighbour mixing before the rule (Allouah et al. "
                         "2023): each gradient becomes the mean of its towers - f nearest; "
                         "0: off (needs towers > 2 nnm)", low=0)


def mixes(options) -> bool:
    """True: these options mix (nnm > 0) before the rule."""
    return getattr(options, "nnm", 0) > 0


class GatherAtRoot(Aggregation):
    """A method whose `combine` maps every tower's gradients (gathered on tower 0) to one
    gradient per variable, broadcast to every replica."""

    capabilities = Capabilities(
        layout=REPLICATED, exact=False, summable=False,
        runs_between_processes=True,  # its transports reach other processes (peers.py)
        unsummable_reason="it compares every tower's whole gradients, gathered on tower 0 "
                          "(no element-wise sum to pack or ring-reduce)",
        across_workers=False,
        copies_per_device=True)  # one copy per device; towers sharing a device read it

    def parameter_devices(self):
        return list(self.devices.copy_devices)

    @classmethod
    def requirements(cls) -> dict:
        """option -> (the least tower count as a formula, that count for the option's value,
        the option's largest value for T towers): what `check` asks of the tower count
        (a subclass adds its own to these)."""
        return {"nnm": ("2 nnm + 1", lambda v: 2 * v + 1 if v else 1, lambda t: (t - 1) // 2)}

    @classmethod
    def min_towers(cls, options) -> int:
        """The fewest towers these options run on (every requirement met)."""
        return max(least(getattr(options, name))
                   for name, (_, least, _) in cls.requirements().items())

    @classmethod
    def check(cls, request, options):
        """Refuses (one line) fewer towers than `min_towers` (nearest-neighbour mixing needs
        T > 2 nnm; a subclass's own requirements too), naming what would run."""
        num = request.num_towers
        if num >= cls.min_towers(options):
            return
        needs = cls.requirements()
        failing = [f"{formula} = {least(getattr(options, name))} for "
                   f"{name}={getattr(options, name)}"
                   for name, (formula, least, _) in needs.items()
                   if least(getattr(options, name)) > num]
        bounds = {name: most(num) for name, (_, _, most) in needs.items()}
        lower = (" and ".join(f"{name} <= {bounds[name]}" for name in needs
                           if getattr(options, name) > bounds[name])
                 if min(bounds.values()) >= 0 else None)  # else no option value runs
        minimum = cls.min_towers(options)
        raise TowerCountError(options_spec(cls, options), f"at least {minimum}",
                              f"({'; '.join(failing)})", request, lower,
                              lambda n: n >= minimum, f"at least {minimum}")

    def mix(self, stacked: list[tf.Tensor]) -> list[tf.Tensor]:
        """`stacked` after nearest-neighbour mixing (nnm.py) when the options ask for it."""
        if not mixes(self.options):
            return stacked
        return nnm_lib.mix(stacked, flat_rows(stacked), self.options.nnm)

    @abc.abstractmethod
    def combine(self, stacked: list[tf.Tensor]) -> list[tf.Tensor]:
        """stacked[v]: float tensor [T, *shape of v], row t tower t's gradient (on tower 0).
        Returns A(...)[v] for every v, shaped like v, on tower 0."""

    def reduce(self, tower_values, variables, average=True):
        if self.peers is not None:
            return self._reduce_between_workers(tower_values, average)
        towers = list(self.devices.towers)
        root = towers[0]
        received = [[self.send(g, device, root) for g in values]
                    for values, device in zip(tower_values, towers)]
        with tf.device(root):
            stacked = [stacked_rows.stack(list(per_var)) for per_var in zip(*received)]
            combined = self.combine(self.mix(stacked))
            if not average:
                combined = [x * float(self.num_towers) for x in combined]
        per_var = [[self.send(x, root, device) for device in self.devices.copy_devices]
                   for x in combined]
        return [list(per_copy) for per_copy in zip(*per_var)]

    def _reduce_between_workers(self, tower_values, average):
        """Between worker processes (peers.py): every worker gathers every worker's
        gradients (one all-gather of all of them) and computes `combine` itself, from the
        same bits in the same order, so no broadcast follows: each worker sends and
        receives (W-1) P bytes."""
        device = self.devices.towers[0]
        have = ring_all_gather(self, [tuple(tower_values[0])], [device])[0]
        with tf.device(device):
            stacked = [tf.stack(per_var) for per_var in zip(*have)]
            combined = self.combine(self.mix(stacked))
            if not average:
                combined = [x * float(self.num_towers) for x in combined]
        return [combined]


def flat_rows(stacked: list[tf.Tensor]) -> tf.Tensor:
    """[T, D]: row t tower t's whole gradient vector, every variable flattened in order."""
    num = stacked[0].shape[0]
    return tf.concat([tf.reshape(x, [num, -1]) for x in stacked], axis=1)


def options_spec(method, options) -> str:
    """`name:key=value,...` with every option, defaults too."""
    return method.name + "".join((":" if i == 0 else ",") + f"{f.name}={getattr(options, f.name)}"
                                 for i, f in enumerate(dataclasses.fields(options)))


def towers_given(request) -> str:
    """What gives `request`'s towers, as flags."""
    if getattr(request, "towers_per_device", 1) > 1:
        return (f"--devices ({request.num_devices} devices) x --towers_per_device="
                f"{request.towers_per_device} gives {request.num_towers} towers")
    return f"--devices gives {request.num_towers} towers"


class TowerCountError(ConfigError):
    """A method's refusal of the count of towers it runs on, worded for towers; `at_nodes`
    words it for the nodes or workers it runs between (validation.py)."""

    def __init__(self, spec: str, needed: str, why: str, request, lower: str | None,
                 fits, count_hint: str):
        self.spec, self.needed, self.why, self.lower = spec, needed, why, lower
        self.count, self.fits, self.count_hint = request.num_towers, fits, count_hint
        use = ([f"{lower}"] if lower else []) + [f"{count_hint} towers"]
        super().__init__(f"--aggregation={spec} needs {needed} towers {why}; "
                         f"{towers_given(request)}: use {either(use)}")

    def at_nodes(self, given: str, towers: int | None) -> str:
        """The message for the method between nodes: `given` says what gives the nodes
        (e.g. `--nodes=4 gives 4 nodes`); `towers`: the run's towers, which --nodes may
        divide otherwise and --method_at=towers would hand the method (None: several
        workers, each a node, where neither applies)."""
        use = [self.lower] if self.lower else []
        if towers is None:
            use.append(f"{self.count_hint} workers")
        else:
            counts = [n for n in range(2, towers + 1) if towers % n == 0 and self.fits(n)]
            use += ([f"--nodes={' or '.join(map(str, counts[:3]))}"] if counts else
                    [f"{self.count_hint} nodes (more towers, and --nodes dividing them)"])
            if self.fits(towers):
                use.append(f"--method_at=towers (the method then sees the {towers} towers)")
        return (f"--aggregation={self.spec} between nodes needs {self.needed} nodes "
                f"{self.why}; {given}: use {either(use)}")


def either(choices: list[str]) -> str:
    """`a`, `a or b`, `a, b or c`."""
    return " or ".join([", ".join(choices[:-1]), choices[-1]] if len(choices) > 2 else choices)


def refuse_towers(method, request, options, needed: str, why: str, fits,
                  count_hint: str) -> None:
    """Raises TowerCountError: `method` with `options` cannot run on request's tower count;
    it needs `needed` (e.g. "a power-of-two count of") towers `why`; `fits(n)`: whether n
    towers would do; `count_hint`: those counts in words (e.g. "2 or 4")."""
    raise TowerCountError(options_spec(method, options), needed, why, request, None, fits,
                          count_hint)
