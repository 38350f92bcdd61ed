"""Per-node state across workers: what only this worker's node holds, saved by it.

With several workers and the method at the nodes (aggregation/nodes.py, peers.py), each
worker is a node and holds state no other worker has: the method's state for its node
(error-feedback residuals, PowerSGD's Q, the exchange counters, DiLoCo's outer x and
momentum) and, for a method whose copies differ between its synchronisations (local
SGD, DiLoCo), the node's own variable copies and optimizers. The chief's checkpoint
(checkpoint.py) holds the chief's; every worker w also saves its node's into

    <logdir>/checkpoints/node-<w>/ckpt-<step>

at the same steps as the chief's checkpoint (the controller calls `save` on every worker
at the same steps), through tf.train.CheckpointManager (written to a temporary name
and renamed, so never half-written; the last --keep_checkpoints kept). A resumed run
restores the chief's checkpoint of step s on every worker, then its node's checkpoint
of the same step, and does not broadcast the node's variables from the chief
(replicas.py), so every node resumes with its own state, as an uninterrupted run has it.
A node checkpoint missing for step s (e.g. written by a run of another worker count) is
refused in one line rather than silently replaced by the chief's state.
"""

from __future__ import annotations

import os

import tensorflow as tf

from mgloop.errors import ConfigError
from mgloop.spec.variables import backing


def node_variables(aggregation, copies) -> list[tf.Variable]:
    """The variables only this worker's node holds (module docstring); [] when the method
    is not between workers at the nodes."""
    local = getattr(aggregation, "local", None)
    if local is None or not getattr(local, "exchanges_between_workers", False):
        return []
    out = list(local.state_variables)
    if aggregation.copies_differ:
        for copy in copies:
            out += [*copy.variables, *(backing(v) for v in copy.optimizer.variables)]
    return out


class NodeCheckpoints:
    """Saves this worker's node variables beside `main` (the chief's Checkpointer, or None
    on the other workers); `save` and `latest` as the controller calls them."""

    def __init__(self, directory: str, index: int, variables: list, keep: int, main=None):
        self.main = main
        self.directory = os.path.join(directory, f"node-{index}")
        holder = tf.Module()
        holder.node = list(variables)
        self._checkpoint = tf.train.Checkpoint(node=holder)
        self._manager = tf.train.CheckpointManager(self._checkpoint, self.directory,
                                                   max_to_keep=keep)

    @property
    def latest(self) -> str | None:
        return self.main.latest if self.main is not None else self._manager.latest_checkpoint

    def save(self, step: int) -> str:
        self._manager.save(checkpoint_number=step)
        return self.main.save(step) if self.main is not None else self.latest

    def restore(self, step: int, logdir: str) -> None:
        """This node's checkpoint of `step` (the step the chief's checkpoint restored)."""
        prefix = os.path.join(self.directory, f"ckpt-{step}")
        if not tf.io.gfile.exists(prefix + ".index"):
            raise ConfigError(
                f"--logdir={logdir}: the checkpoint of step {step} has no {prefix} with this "
                "node's own state (error feedback, local copies); resume with the worker "
                "count that wrote it, or use a fresh --logdir")
        self._checkpoint.restore(prefix).assert_existing_objects_matched()
