"""`Traffic`: the bytes and messages each device sends and receives in one step.

Recorded by `Aggregation.send` (base.py) while a step is traced, so the counts are what
the algorithm moves per step, exactly; read by the summaries and the link model
(mgloop/observe/link_model.py).

Tiers and kinds. Every count also lands in one of four parts, (tier, kind):
the tier is `within` when both devices are in one node and `between` otherwise
(`node_of`, canonical device -> node, set by aggregation/nodes.py; with no map every
device is in node 0, and the collective between workers says `between` itself, each
worker being a node); the kind is `gradient` (what the method exchanges: gradients,
payloads, parameters it averages) or `state` (batch-norm statistics and the step's
metrics, counted inside `counting_state()`).
"""

from __future__ import annotations

import contextlib
import dataclasses

TIERS = ("within", "between")
KINDS = ("gradient", "state")


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
        (`spanning_tier`)."""
        part = self.part(tier or self.spanning_tier(), self.kind)
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

    def snapshot(self) -> "Traffic":
        return Traffic(*(dict(counts) for counts in self._counts()), node_of=self.node_of,
                       kind=self.kind, parts={k: p.snapshot() for k, p in self.parts.items()})

    def restore(self, snapshot: "Traffic") -> None:
        """Sets the counts back to `snapshot`'s, in place (the object may be shared)."""
        for counts, saved in zip(self._counts(), snapshot._counts()):
            counts.clear()
            counts.update(saved)
        self.parts.clear()
        self.parts.update({k: p.snapshot() for k, p in snapshot.parts.items()})

    def repeat_since(self, before: "Traffic", times: int) -> None:
        """Counts what was recorded since the snapshot `before` `times` times in all (a part
        of the step traced once that runs `times` times, e.g. accumulation's micro-batches)."""
        for counts, earlier in zip(self._counts(), before._counts()):
            for device in list(counts):
                counts[device] += (times - 1) * (counts[device] - earlier.get(device, 0))
        for key, part in self.parts.items():
            part.repeat_since(before.parts.get(key, Traffic()), times)

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
