"""`MeasuredBytes`: bytes counted when the step runs, for sends whose length the data decides.

mgloop counts bytes while a step is traced (traffic.py), from the static shapes of what
`send` and the collectives move. A payload whose length only the data decides (threshold's
entries that pass, compression/sizes_first.py) has no static shape, so its bytes are added
when the step runs to two int64 totals per device, `sent` and `received` (tf.Variables on
that device, made by `build`). Its messages are static (one per send, or the collective's)
and are recorded when traced, as every other send's.

The totals are contract state of the method that owns them (listed in its
`state_variables`): checkpointed and restored with it, so that a resumed run's totals
cover every step since step 0, and restored by the exchange timing as all state is. When
traced, each send registers its totals with the Traffic under its (device, tier, kind,
occasion) (`Traffic.measure`); after training `Traffic.with_measured` divides each total by
the number of steps its occasion occurred on, which observe/link_report.py's `Schedule`
does for every report: the summaries and the link model then see the mean bytes per step
of what ran. Figures of single steps (a run's slowest step, a study's bytes through step
p) take that mean for every step: the totals are kept per run, not per step.
"""

from __future__ import annotations

import tensorflow as tf

from mgloop.cluster.devices import canonical


class MeasuredBytes:
    """Run-time byte totals of `devices` (module docstring), named after the method."""

    def __init__(self, name: str):
        self.name = name
        self.sent: dict[str, tf.Variable] = {}  # canonical device -> int64 total
        self.received: dict[str, tf.Variable] = {}

    def build(self, devices) -> None:
        """The totals, zero, one pair per device (made with the method's state)."""
        self.sent, self.received = {}, {}
        for i, device in enumerate(devices):
            if canonical(device) in self.sent:  # several towers on one device: one pair
                continue
            with tf.device(device):
                self.sent[canonical(device)] = tf.Variable(
                    tf.constant(0, tf.int64), trainable=False, name=f"{self.name}_sent_bytes_{i}")
                self.received[canonical(device)] = tf.Variable(
                    tf.constant(0, tf.int64), trainable=False,
                    name=f"{self.name}_received_bytes_{i}")

    @property
    def variables(self) -> list[tf.Variable]:
        """Per device in build order: its sent total, then its received total."""
        return [v for device in self.sent for v in (self.sent[device], self.received[device])]

    def send(self, traffic, value: tf.Tensor, src: str, dst: str) -> tf.Tensor:
        """`value` (1-D uint8 on `src`, of any run-time length) as a tensor on `dst`: one
        message, recorded when traced; its tf.size(value) bytes added to src's sent and
        dst's received totals when the step runs. The same device: nothing moves."""
        src, dst = canonical(src), canonical(dst)
        if src == dst:
            return value
        tier = "within" if traffic.node(src) == traffic.node(dst) else "between"
        traffic.add(src, messages_sent=1, tier=tier)
        traffic.add(dst, messages_received=1, tier=tier)
        traffic.measure(src, tier, sent=self.sent[src])
        traffic.measure(dst, tier, received=self.received[dst])
        with tf.device(src):
            num_bytes = tf.cast(tf.size(value), tf.int64) * value.dtype.size
            self.sent[src].assign_add(num_bytes)
        with tf.device(dst):
            self.received[dst].assign_add(num_bytes)
            return tf.identity(value)

    def collective(self, traffic, device: str, num_bytes: tf.Tensor, messages: int) -> None:
        """A collective's share on `device` between nodes (peers.py): `messages` each way,
        recorded when traced; `num_bytes` (a scalar int64 tensor) sent and received, added
        when the step runs."""
        device = canonical(device)
        traffic.add(device, messages_sent=messages, messages_received=messages, tier="between")
        traffic.measure(device, "between", sent=self.sent[device],
                        received=self.received[device])
        with tf.device(device):
            self.sent[device].assign_add(num_bytes)
            self.received[device].assign_add(num_bytes)
