"""`Traffic`: the bytes and messages each device sends and receives in one step.

Recorded by `Aggregation.send` (base.py) while a step is traced, so the counts are what
the algorithm moves per step, exactly; read by the summaries and the link model
(mgloop/observe/link_model.py).

Tiers and kinds. Every count also lands in one of four parts, (tier, kind):
the tier is `within` when both devices are in one node and `between` otherwise
(`node_of`, canonical device -> node, set by placement/between_nodes.py; with no map every
device is in node 0, and the collective between workers says `between` itself, each
worker being a node); the kind is `gradient` (what the method exchanges: gradients,
payloads, parameters it averages) or `state` (batch-norm statistics and the step's
metrics, counted inside `counting_state()`).

Occasions. A traced step holds every branch of the step, so what it counts is what a step
moves when everything in it runs. A method whose sends run only on some steps (a sync
every H steps, a fragment's outer step, a warmup) records them inside
`on(Occasion(name, occurs))`, `occurs(s)` saying whether the 0-based global step s runs
them; everything else is `EVERY_STEP`. An occasion's `overlap_steps` k > 0 says its
exchange may run behind the compute of the k steps that follow (Streaming DiLoCo's
overlap tau, or a whole period with eager updates: aggregation/local/overlap.py), which the
link report charges as such. Each occasion's counts are also kept apart
(`by_occasion`), so what step s moves is the sum of the occasions that occur at s
(`at_step`), and a run's bytes per step are averaged over its steps from that
(observe/link_report.py).

Measured. A send whose length the data decides (threshold's entries that pass) has no
static shape: its message is recorded when traced, its bytes when the step runs, into
int64 totals (aggregation/measured.py) that `measure` registers under the send's
(device, tier, kind, occasion); `with_measured` adds each total divided by the steps its
occasion occurred on (the run's mean per step) to a copy of the counts, as the link report
reads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

TIERS = ("within", "between")
KINDS = ("gradient", "state")


@dataclasses.dataclass(frozen=True)
class Occasion:
    """The steps on which a part of the step sends: `occurs(s)` for the 0-based global
    step s. `name` says which part (e.g. "sync", "fragment 2"); one name, one rule.
    `overlap_steps` k: the exchange recorded on it may overlap the compute of the k steps
    after s (its result is used k steps later); 0: the step waits for it."""

    name: str
    occurs: Callable[[int], bool]
    overlap_steps: int = 0


EVERY_STEP = Occasion("every step", lambda step: True)


@dataclasses.dataclass(frozen=True)
class Sync:
    """One synchronisation a local method runs after the update: on `occasion`'s steps,
    when the tensor `due()` is true; it changes the trainable `variables` (indices; None:
    all of them) and, with `slots`, the optimizer's slots (True: all; "momentums" or
    "velocities": Adam's first or second moments alone, local_steps.slot_variables)."""

    occasion: Occasion
    due: Callable
    variables: tuple[int, ...] | None = None
    slots: bool | str = False


@dataclasses.dataclass
class Traffic:
    """Bytes and messages sent and received per device in one step, keyed by canonical device.

    A message is one transfer between two devices (one `send`); a kernel that moves its
    tensors itself (collective.py, cross_worker.py) adds the messages of its algorithm. The
    message counts are what the link model (mgloop/observe/link_model.py) charges latency for."""

    sent: dict[str, int] = dataclasses.field(default_factory=dict)
    received: dict[str, int] = dataclasses.field(default_factory=dict)
    messages_sent: dict[str, int] = dataclasses.field(default_factory=dict)
    messages_received: dict[str, int] = dataclasses.field(default_factory=dict)
    node_of: dict[str, int] = dataclasses.field(default_factory=dict)  # device -> its node
    kind: str = "gradient"  # the kind recorded now (counting_state switches it)
    parts: dict = dataclasses.field(default_factory=dict)  # (tier, kind) -> Traffic
    occasion: Occasion = EVERY_STEP  # the occasion recorded now (`on` switches it)
    by_occasion: dict = dataclasses.field(default_factory=dict)  # name -> (Occasion, Traffic)
    # (device, tier, kind, occasion name) -> (Occasion, [sent totals], [received totals])
    measured: dict = dataclasses.field(default_factory=dict)

    def record(self, src: str, dst: str, num_bytes: int) -> None:
        """One message of `num_bytes` from `src` to `dst`."""
        tier = "within" if self.node(src) == self.node(dst) else "between"
        self.add(src, sent=num_bytes, messages_sent=1, tier=tier)
        self.add(dst, received=num_bytes, messages_received=1, tier=tier)

    def node(self, device: str) -> int:
        return self.node_of.get(device, 0)

    def tier_of(self, devices) -> str:
        """The tier of a collective over `devices` (canonical): within if one node holds
        them all."""
        return "within" if len({self.node(d) for d in devices}) <= 1 else "between"

    def spanning_tier(self) -> str:
        """The tier of a collective over every device: between when they span nodes."""
        return "between" if len(set(self.node_of.values())) > 1 else "within"

    def add(self, device: str, sent: int = 0, received: int = 0, messages_sent: int = 0,
            messages_received: int = 0, tier: str | None = None) -> None:
        """Counts on `device`; `tier`: None, a collective over every device
        (`spanning_tier`). Counted in the whole, in its (tier, kind) part, and in the same
        part of the occasion recorded now."""
        tier = tier or self.spanning_tier()
        name = self.occasion.name
        if name not in self.by_occasion:  # one name, one rule: the first one recorded
            self.by_occasion[name] = (self.occasion, Traffic(node_of=self.node_of))
        occasion_traffic = self.by_occasion[name][1]
        occasion_traffic._add(device, sent, received, messages_sent, messages_received, tier,
                              self.kind)
        self._add(device, sent, received, messages_sent, messages_received, tier, self.kind)

    def _add(self, device, sent, received, messages_sent, messages_received, tier, kind):
        part = self.part(tier, kind)
        for target in (self, part):
            for counts, value in ((target.sent, sent), (target.received, received),
                                  (target.messages_sent, messages_sent),
                                  (target.messages_received, messages_received)):
                counts[device] = counts.get(device, 0) + value

    def part(self, tier: str, kind: str) -> "Traffic":
        """The counts of one (tier, kind), made empty when first asked for."""
        if (tier, kind) not in self.parts:
            self.parts[tier, kind] = Traffic()
        return self.parts[tier, kind]

    def tier(self, tier: str) -> "Traffic":
        """The counts of one tier, both kinds together."""
        total = Traffic()
        for kind in KINDS:
            part = self.parts.get((tier, kind))
            for device in part.devices() if part else ():
                for mine, theirs in zip(total._counts(), part._counts()):
                    mine[device] = mine.get(device, 0) + theirs.get(device, 0)
        return total

    @contextlib.contextmanager
    def on(self, occasion: Occasion):
        """What is recorded inside is sent only on the steps where `occasion` occurs."""
        outer, self.occasion = self.occasion, occasion
        try:
            yield
        finally:
            self.occasion = outer

    def measure(self, device: str, tier: str, sent=None, received=None) -> None:
        """Registers run-time totals (aggregation/measured.py: int64 tf.Variables of the bytes
        `device` sent or received over the run's steps) under the kind and occasion recorded
        now; each total once."""
        key = (device, tier, self.kind, self.occasion.name)
        _, sents, receives = self.measured.setdefault(key, (self.occasion, [], []))
        for total, into in ((sent, sents), (received, receives)):
            if total is not None and not any(known is total for known in into):
                into.append(total)

    def with_measured(self, occurrences: Callable[[str], int]) -> "Traffic":
        """A copy whose counts add, for each measured total, total / occurrences(its
        occasion's name) (its mean per step on which the occasion occurred); self when
        nothing is measured."""
        if not self.measured:
            return self
        out = self.snapshot()
        out.measured = {}
        for (device, tier, kind, name), (occasion, sents, receives) in self.measured.items():
            times = occurrences(name)
            if times:
                out.occasion, out.kind = occasion, kind
                out.add(device, sent=sum(int(t.numpy()) for t in sents) / times,
                        received=sum(int(t.numpy()) for t in receives) / times, tier=tier)
        out.occasion, out.kind = self.occasion, self.kind
        return out

    def occasions(self) -> list[Occasion]:
        """The occasions recorded, in the order first seen."""
        return [occasion for occasion, _ in self.by_occasion.values()]

    def of_occasion(self, name: str) -> "Traffic":
        """The counts recorded on the occasion `name` (empty if none)."""
        return self.by_occasion[name][1] if name in self.by_occasion else Traffic()

    def occurring(self, step: int) -> tuple[str, ...]:
        """The names of the occasions that occur at the 0-based global step `step`."""
        return tuple(name for name, (occasion, _) in self.by_occasion.items()
                     if occasion.occurs(step))

    def of_occasions(self, names: tuple[str, ...]) -> "Traffic":
        """What a step on which the occasions `names` occur moves: their sum (the whole
        count when they are all of them)."""
        if len(names) == len(self.by_occasion):
            return self
        return Traffic.sum([self.by_occasion[name][1] for name in names], self.node_of)

    def at_step(self, step: int) -> "Traffic":
        """What the 0-based global step `step` moves."""
        return self.of_occasions(self.occurring(step))

    @staticmethod
    def sum(traffics, node_of=None) -> "Traffic":
        """The counts of `traffics` added up, per device and per (tier, kind) part."""
        total = Traffic(node_of=dict(node_of or {}))
        for traffic in traffics:
            total.add_scaled(traffic, 1)
        return total

    def add_scaled(self, other: "Traffic", times: float) -> None:
        """Adds `times` x `other`'s counts (whole and per part; `times` may be a fraction:
        an average over steps)."""
        for mine, theirs in zip(self._counts(), other._counts()):
            for device, value in theirs.items():
                mine[device] = mine.get(device, 0) + times * value
        for key, part in other.parts.items():
            self.part(*key).add_scaled(part, times)

    @contextlib.contextmanager
    def counting_state(self):
        """What is recorded inside is of kind `state` (statistics, metrics)."""
        kind, self.kind = self.kind, "state"
        try:
            yield
        finally:
            self.kind = kind

    def _counts(self) -> tuple[dict[str, int], ...]:
        return self.sent, self.received, self.messages_sent, self.messages_received

    def clear(self) -> None:
        for counts in self._counts():
            counts.clear()
        self.parts.clear()
        self.by_occasion.clear()
        self.measured.clear()

    def snapshot(self) -> "Traffic":
        return Traffic(*(dict(counts) for counts in self._counts()), node_of=self.node_of,
                       kind=self.kind, parts={k: p.snapshot() for k, p in self.parts.items()},
                       occasion=self.occasion,
                       by_occasion={name: (occasion, traffic.snapshot())
                                    for name, (occasion, traffic) in self.by_occasion.items()},
                       measured=_copied(self.measured))

    def restore(self, snapshot: "Traffic") -> None:
        """Sets the counts back to `snapshot`'s, in place (the object may be shared)."""
        for counts, saved in zip(self._counts(), snapshot._counts()):
            counts.clear()
            counts.update(saved)
        self.parts.clear()
        self.parts.update({k: p.snapshot() for k, p in snapshot.parts.items()})
        self.by_occasion.clear()
        self.by_occasion.update({name: (occasion, traffic.snapshot()) for name, (
            occasion, traffic) in snapshot.by_occasion.items()})
        self.measured.clear()
        self.measured.update(_copied(snapshot.measured))

    def repeat_since(self, before: "Traffic", times: int) -> None:
        """Counts what was recorded since the snapshot `before` `times` times in all (a part
        of the step traced once that runs `times` times, e.g. accumulation's micro-batches)."""
        for counts, earlier in zip(self._counts(), before._counts()):
            for device in list(counts):
                counts[device] += (times - 1) * (counts[device] - earlier.get(device, 0))
        for key, part in self.parts.items():
            part.repeat_since(before.parts.get(key, Traffic()), times)
        for name, (_, traffic) in self.by_occasion.items():
            earlier = before.by_occasion.get(name)
            traffic.repeat_since(earlier[1] if earlier else Traffic(), times)

    def devices(self) -> list[str]:
        return sorted(set(self.sent) | set(self.received))

    def as_dict(self) -> dict[str, dict[str, int]]:
        """Bytes per device: {device: {"sent": ..., "received": ...}}."""
        return {d: {"sent": self.sent.get(d, 0), "received": self.received.get(d, 0)}
                for d in self.devices()}

    def messages_as_dict(self) -> dict[str, dict[str, int]]:
        """Messages per device: {device: {"sent": ..., "received": ...}}."""
        return {d: {"sent": self.messages_sent.get(d, 0),
                    "received": self.messages_received.get(d, 0)} for d in self.devices()}

    def busiest(self) -> tuple[int, int]:
        """(bytes, messages) of the busiest device, each max(sent, received)."""
        return (max((max(self.sent.get(d, 0), self.received.get(d, 0))
                     for d in self.devices()), default=0),
                max((max(self.messages_sent.get(d, 0), self.messages_received.get(d, 0))
                     for d in self.devices()), default=0))

    def tiers_as_dict(self) -> dict:
        """{tier: {kind: {"bytes_per_device", "messages_per_device", "bytes_sent"}}}: the
        busiest device's bytes and messages of each part, and the bytes all its devices
        send."""
        out = {}
        for tier in TIERS:
            out[tier] = {}
            for kind in KINDS:
                part = self.parts.get((tier, kind), Traffic())
                num_bytes, messages = part.busiest()
                out[tier][kind] = {"bytes_per_device": num_bytes,
                                   "messages_per_device": messages,
                                   "bytes_sent": sum(part.sent.values())}
        return out


def _copied(measured: dict) -> dict:
    """`Traffic.measured` with its lists copied (the totals themselves shared)."""
    return {key: (occasion, list(sents), list(receives))
            for key, (occasion, sents, receives) in measured.items()}
