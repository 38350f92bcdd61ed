"""Large gradients summed tower by tower, so that at most two full-size copies are alive.

In a shared layout (the parameter-server modes) every tower computes the full
gradient g[t][v] of every variable v, and the aggregation forms

    g[v] = (1/T) * sum_t g[t][v]          (on home(v), the variable's device)

The towers run concurrently, so all T gradients of a variable exist before
their sum: when the towers are logical devices of one host (`--devices=cpu:N`)
that is T full-size copies in the same memory, T - 1 more than one device
holds (for big_mlp's 122 MiB first kernel on 4 towers, 366 MiB more).

For every variable of at least `min_bytes` bytes, `OrderedSum` forms instead

    s_0[v] = g[0][v],    s_t[v] = s_{t-1}[v] + g[t][v]     (on home(v), in tower order)

and tower t's backward pass starts only once s_{t-1}[v] exists for every such
v (a control dependency on the tape's gradient ops), so tower t's large
gradients are produced after tower t-1's have been added and freed: at most
the sum and one tower's gradient are alive, and the tensors of such variables
hold two copies instead of T. The aggregation then scales s_{T-1}[v] on home(v)
(`reduce`); the other variables go through the aggregation as usual.

The price is overlap: the towers' backward passes run one after another (their
forward passes still overlap). Each g[t][v] is sent to home(v) once, as in the
unordered sum, so the traffic counts are unchanged; the T terms are added in
tower order rather than by one AddN, which can change the last bits of float32.

It applies (`applies`) where the towers' gradients share the host's memory and
meet at one home: a shared layout summed at each variable's device (ps_cpu,
ps_device, ps_spread) on logical CPU towers. Not on GPUs, where each tower's
gradient lives in its own device's memory and serialising the backward passes
would idle the devices; not with accumulation or synchronised batch norm (see
`assemble.large_gradient_hooks`); where it applies, the exchange is not packed.
A large dense kernel that sufficient_factors.py factors has no per-tower gradient
to order: its sum comes from the factors, and only the other large variables are
ordered.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from mgloop.aggregation.base import SHARED, Aggregation



def applies(aggregation: Aggregation) -> bool:
    """Whether several towers' gradients meet at one home each, in the host's memory."""
    return (aggregation.capabilities.layout == SHARED and aggregation.capabilities.sums_at_home
            and aggregation.devices.simulated and aggregation.num_towers > 1)


def num_bytes(variable) -> int:
    return variable.shape.num_elements() * variable.dtype.size


class OrderedSum:
    """The running sums s_t[v] of the variables of at least `min_bytes`, built while tracing.

    Use, for towers t = 0 .. T-1 in order: build tower t's backward pass under
    `tf.control_dependencies(self.gate())`, then `add(tower t's gradients, its device)`.
    """

    def __init__(self, aggregation: Aggregation, variables: Sequence[tf.Variable],
                 min_bytes: int):
        self.aggregation = aggregation
        self.variables = list(variables)
        self.indices = [i for i, v in enumerate(self.variables) if num_bytes(v) >= min_bytes]
        self.sums: dict[int, tf.Tensor] = {}  # variable index -> s_t on its home

    def gate(self) -> list[tf.Tensor]:
        """What the next tower's backward pass waits for: the sums so far (none for tower 0)."""
        return list(self.sums.values())

    def add(self, grads: Sequence[tf.Tensor], device: str) -> None:
        """Adds one tower's gradients (on `device`) of the large variables into their sums."""
        for i in self.indices:
            if grads[i] is None:  # factored (sufficient_factors.py): no gradient of its own
                continue
            home = self.aggregation.home_of(self.variables[i])
            received = self.aggregation.send(grads[i], device, home)
            with tf.device(home):
                self.sums[i] = received if i not in self.sums else self.sums[i] + received


def reduce(aggregation: Aggregation, tower_grads: Sequence[Sequence[tf.Tensor]],
           variables: Sequence[tf.Variable], sums: dict[int, tf.Tensor],
           average: bool) -> list[list[tf.Tensor]]:
    """The aggregation's reduce, the variables in `sums` scaled from the sums already formed
    at their homes (ordered here, or from sufficient factors: sufficient_factors.py).

    Returns [g] (one shared copy): g[v] = scale(sums[v]) on home(v) for v in `sums`,
    the aggregation's reduce of the towers' gradients for the others.
    """
    rest = [i for i in range(len(variables)) if i not in sums]
    out: list[tf.Tensor | None] = [None] * len(variables)
    if rest:
        reduced = aggregation.reduce([[grads[i] for i in rest] for grads in tower_grads],
                                     [variables[i] for i in rest], average)
        for i, value in zip(rest, reduced[0]):
            out[i] = value
    for i, total in sums.items():
        with tf.device(aggregation.home_of(variables[i])):
            out[i] = aggregation.scale(total, average)
    return [out]
