"""The ordered sum (ordered_sum.py) and sufficient factors (sufficient_factors.py) of large
gradients as hooks: the towers' gradients of those variables are summed at their homes as
the towers finish (`after_tower`), and handed to the exchange already summed
(`home_sums`), which only scales them (exchange.HomeSums).

    OrderedSumHook        tower t's backward waits for s_{t-1} (`before_backward`); its
                          large gradients are added into s_t at home (`after_tower`)
    SufficientFactorsHook tower t's forward is traced in a `TowerForward` (`tower_scope`),
                          its backward asks for dz_t instead of x_t^T dz_t (`gradients`),
                          its factors go home (`after_tower`), X^T dZ is formed there

Each starts afresh per traced step (`step_scope`), so the exchange timing
(exchange_timing.py) can run the same path on stand-in tower outputs.
"""

from __future__ import annotations

import contextlib


from mgloop.step import ordered_sum
from mgloop.step import sufficient_factors
from mgloop.step.hooks import Hook, tape_gradients


class OrderedSumHook(Hook):
    def __init__(self, aggregation, variables, min_bytes: int, tower_devices: list[str]):
        self.aggregation, self.variables, self.min_bytes = aggregation, variables, min_bytes
        self.tower_devices = list(tower_devices)
        self.indices = ordered_sum.OrderedSum(aggregation, variables, min_bytes).indices
        self.summed_at_home = self.indices  # no tower keeps its whole gradient of these
        self.order = None
        self.summed: list[int] = []  # what the last traced step summed in tower order

    @contextlib.contextmanager
    def step_scope(self):
        self.order = ordered_sum.OrderedSum(self.aggregation, self.variables, self.min_bytes)
        yield

    def before_backward(self, t):
        return self.order.gate()

    def after_tower(self, t, out):
        self.order.add(out.grads, self.tower_devices[t])

    def home_sums(self):
        self.summed = sorted(self.order.sums)
        return dict(self.order.sums)


class SufficientFactorsHook(Hook):
    def __init__(self, aggregation, variables, min_bytes: int, tower_devices: list[str]):
        self.aggregation, self.variables, self.min_bytes = aggregation, variables, min_bytes
        self.tower_devices = list(tower_devices)
        self.candidates = sufficient_factors.SufficientFactors(
            aggregation, variables, min_bytes).candidates
        self.summed_at_home = self.candidates  # those it may factor (found when traced)
        self.factors = None
        self.forward: dict[int, sufficient_factors.TowerForward] = {}
        self.factored: list[int] = []  # what the last traced step formed from factors

    @contextlib.contextmanager
    def step_scope(self):
        self.factors = sufficient_factors.SufficientFactors(self.aggregation, self.variables,
                                                            self.min_bytes)
        self.forward = {}
        yield

    def tower_scope(self, t):
        self.forward[t] = self.factors.tower()
        return self.forward[t]

    def gradients(self, t, tape, target, values):
        """The tower's backward with its factorable products factored (the Hooks' backward)."""
        forward = self.forward[t]
        products = forward.products(values)
        return (forward.gradients(target, values, products) if products
                else tape_gradients(t, tape, target, values))

    def after_tower(self, t, out):
        self.factors.add(out.factors, self.tower_devices[t])

    def home_sums(self):
        self.factored = sorted(self.factors.received)
        return self.factors.sums()
