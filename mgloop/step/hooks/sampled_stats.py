"""`--diagnostics` as a hook of the sampled step (diagnostics.py): the towers' gradient
statistics from what they hand the exchange (`observe`), and the replica divergence once
every copy holds the step's update (`report`: {"stats": float32 [len(stat_names)]});
with --byzantine_towers, then `tower_<t>/byzantine` of this worker's towers (1: altered)."""

from __future__ import annotations

import tensorflow as tf

from mgloop.observe import diagnostics
from mgloop.step.hooks import Hook


class GradientStats(Hook):
    """`leave_out`: indices of variables the statistics skip (large gradients summed at
    their homes: no tower keeps its whole gradient of them, assemble.summed_at_home)."""

    def __init__(self, tower_devices: list[str], host: str, copies, leave_out=(),
                 byzantine=None):
        self.tower_devices, self.host, self.copies = list(tower_devices), host, copies
        self.leave_out = set(leave_out)
        self.byzantine = byzantine  # hooks/attack_hook.py's hook, or None
        self.names = diagnostics.stat_names(len(self.tower_devices), byzantine is not None)
        self._stats = None

    def observe(self, losses, grads):
        kept = [[g for i, g in enumerate(tower) if i not in self.leave_out and g is not None]
                for tower in grads]
        self._stats = diagnostics.gradient_stats(losses, kept, self.tower_devices, self.host)

    def report(self, done):
        with tf.control_dependencies([done]):  # after every copy's update
            divergence = diagnostics.replica_divergence(self.copies)
        with tf.device(self.host):
            parts = [self._stats, divergence[None]]
            if self.byzantine is not None:  # this worker's towers' entries
                first = self.byzantine.first_tower
                parts.append(self.byzantine.flags()[first:first + len(self.tower_devices)])
            return {"stats": tf.concat(parts, 0)}
