"""`Traffic`: the bytes and messages each device sends and receives in one step.

Recorded by `Aggregation.send` (base.py) while a step is traced, so the counts are what
the algorithm moves per step, exactly; read by the summaries and the link model
(mgloop/link_model.py).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Traffic:
    """Bytes and messages sent and received per device in one step, keyed by canonical device.

    A message is one transfer between two devices (one `send`); a kernel that moves its
    tensors itself (collective.py, cross_worker.py) adds the messages of its algorithm. The
    message counts are what the link model (mgloop/link_model.py) charges latency for."""

    sent: dict[str, int] = dataclasses.field(default_factory=dict)
    received: dict[str, int] = dataclasses.field(default_factory=dict)
    messages_sent: dict[str, int] = dataclasses.field(default_factory=dict)
    messages_received: dict[str, int] = dataclasses.field(default_factory=dict)

    def record(self, src: str, dst: str, num_bytes: int) -> None:
        """One message of `num_bytes` from `src` to `dst`."""
        self.add(src, sent=num_bytes, messages_sent=1)
        self.add(dst, received=num_bytes, messages_received=1)

    def add(self, device: str, sent: int = 0, received: int = 0, messages_sent: int = 0,
            messages_received: int = 0) -> None:
        for counts, value in ((self.sent, sent), (self.received, received),
                              (self.messages_sent, messages_sent),
                              (self.messages_received, messages_received)):
            counts[device] = counts.get(device, 0) + value

    def _counts(self) -> tuple[dict[str, int], ...]:
        return self.sent, self.received, self.messages_sent, self.messages_received

    def clear(self) -> None:
        for counts in self._counts():
            counts.clear()

    def snapshot(self) -> "Traffic":
        return Traffic(*(dict(counts) for counts in self._counts()))

    def restore(self, snapshot: "Traffic") -> None:
        """Sets the counts back to `snapshot`'s, in place (the object may be shared)."""
        for counts, saved in zip(self._counts(), snapshot._counts()):
            counts.clear()
            counts.update(saved)

    def repeat_since(self, before: "Traffic", times: int) -> None:
        """Counts what was recorded since the snapshot `before` `times` times in all (a part
        of the step traced once that runs `times` times, e.g. accumulation's micro-batches)."""
        for counts, earlier in zip(self._counts(), before._counts()):
            for device in list(counts):
                counts[device] += (times - 1) * (counts[device] - earlier.get(device, 0))

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
