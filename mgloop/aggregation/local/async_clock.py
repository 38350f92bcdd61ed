"""The schedule of `async_diloco` (async_diloco.py, whose docstring states it): each node's
inner steps on its own clock, its rounds (DyLU), its arrivals and the merges of a quorum, as
a function of the global step alone, in Python (what the link report counts) and, for `turn`,
on an int64 tensor too (what the step's guard and the method's state machine read). The
run's glue (--node_speeds handed to the method, its staleness reported) is async_run.py's."""

from __future__ import annotations

import fractions
import math



class Clock:
    """The schedule (async_diloco.py) of `nodes` nodes at `speeds` (() : all 1): rates r_i = a_i /
    b_i, rounds H_i, quorum q; `turn` and `steps_by` take a Python int or an int64 tensor."""

    def __init__(self, speeds, nodes: int, period: int, dynamic: bool, quorum: int,
                 grace: int = 0):
        speeds = [fractions.Fraction(str(s)) for s in (speeds or (1,) * nodes)]
        self.rates = [s / max(speeds) for s in speeds]
        self.rounds = [max(1, math.ceil(period * r)) if dynamic else period for r in self.rates]
        self.quorum, self.grace = quorum or nodes, grace
        self.nodes = nodes
        self._events = []  # (stepped, arrived, merges) per step from 0 (`events`)
        self._state = ([0] * nodes, [False] * nodes, [], [0])

    def steps_by(self, i: int, step):
        """n_i(step): node i's inner steps by the end of `step`."""
        r = self.rates[i]
        return ((step + 1) * r.numerator) // r.denominator

    def turn(self, i: int, step):
        return self.steps_by(i, step) > self.steps_by(i, step - 1)

    def events(self, step: int):
        """(stepped[i], arrived[i], merges) of `step` (the nodes of each merge, in arrival
        order): the state machine of `after_update`, in Python, from step 0 (cached)."""
        done, waiting, pending, reached = self._state  # reached: the step q were pending

        def merge(merges):
            merges.append(tuple(pending))
            for j in pending:
                done[j], waiting[j] = 0, False
            pending.clear()
        while len(self._events) <= step:
            s = len(self._events)
            stepped = [bool(self.turn(i, s)) and not waiting[i] for i in range(self.nodes)]
            arrived = [False] * self.nodes
            merges = []
            for i in range(self.nodes):
                done[i] += stepped[i]
                if stepped[i] and done[i] == self.rounds[i]:
                    arrived[i], waiting[i] = True, True
                    pending.append(i)
                    reached[0] = s if len(pending) == self.quorum else reached[0]
                    if len(pending) == self.nodes or (
                            len(pending) >= self.quorum and not self.grace):
                        merge(merges)
            if len(pending) >= self.quorum and s >= reached[0] + self.grace:
                merge(merges)  # the grace window after the quorum has passed
            self._events.append((tuple(stepped), tuple(arrived), merges))
        return self._events[step]

    def arrives(self, i: int, step: int) -> bool:
        return self.events(step)[1][i]

    def restarts(self, i: int, step: int) -> bool:
        return any(i in merge for merge in self.events(step)[2])
