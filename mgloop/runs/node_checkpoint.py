"""Per-node state across workers: what only this worker's node holds, saved by it.

With several workers and the method at the nodes (placement/between_nodes.py, peers.py), each
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
Each node checkpoint also holds `nodes`, the worker count W that wrote step s, so a
checkpoint is complete when node-0 .. node-(W-1) all hold step s (`incomplete`): a worker
killed between its save and the others' (an elastic job, mgloop/cluster/elastic.py) leaves
an incomplete step, which the restore skips for the newest complete one.

Resuming with another worker count W' (an elastic restart, or a scheduler that restarts
the tasks with another TF_CONFIG) re-deals the nodes' state by one rule:

- node w < min(W, W') restores its own node-w, as an unchanged count does: a survivor
  keeps its copies mid-period, its error feedback, its momenta;
- node w >= W (a node that joins) restores node-0's, then the method's `rejoined` resets
  what was node 0's own (aggregation/base.py): error-feedback memory and own momenta start
  at 0; DiLoCo's family's copies start from x, the outer step's parameters (the inner
  optimizer state and the outer momentum are node 0's, the same as a recovering torchft
  replica loads from a healthy peer); local SGD's copies are node 0's current copies;
- the nodes w >= W' are dropped: their error-feedback memory (what they still owed the
  sum) and their inner progress since the last sync are lost, at most one period of one
  node's updates per lost node;
- a method with state no rule re-deals (`resize_refusal`) is refused in one line.
"""

from __future__ import annotations

import os

import tensorflow as tf

from mgloop.errors import ConfigError
from mgloop.training.variables import backing


def node_variables(aggregation, copies) -> list[tf.Variable]:
    """The variables only this worker's node holds (module docstring); [] when the method
    is not between workers at the nodes."""
    out = aggregation.node_state_variables()
    if out is None:
        return []
    if aggregation.capabilities.copies_differ:
        for copy in copies:
            out += [*copy.variables, *(backing(v) for v in copy.optimizer.variables)]
    return out


def _nodes_of(prefix: str) -> int | None:
    """The worker count saved with the node checkpoint at `prefix`, or None (not saved)."""
    try:
        return int(tf.train.load_variable(prefix, _NODES_KEY))
    except (tf.errors.OpError, ValueError):
        return None


_NODES_KEY = "nodes/.ATTRIBUTES/VARIABLE_VALUE"


def _written_by(directory: str, step: int) -> int:
    """How many workers wrote step `step` in `directory`: the count node-0 saved with it,
    else (a checkpoint from before the count was saved) the node folders holding it."""
    return _nodes_of(os.path.join(directory, "node-0", f"ckpt-{step}")) or len(
        tf.io.gfile.glob(os.path.join(directory, "node-*", f"ckpt-{step}.index")))


def incomplete(directory: str, step: int) -> str | None:
    """Why the checkpoint of `step` in `directory` (<logdir>/checkpoints) lacks a node's
    state, or None: complete (or written with no node state at all)."""
    first = os.path.join(directory, "node-0", f"ckpt-{step}")
    if not tf.io.gfile.exists(first + ".index"):
        others = tf.io.gfile.glob(os.path.join(directory, "node-*", f"ckpt-{step}.index"))
        return f"node-0 has no ckpt-{step}" if others else None
    count = _written_by(directory, step)
    missing = [w for w in range(1, count)
               if not tf.io.gfile.exists(os.path.join(directory, f"node-{w}",
                                                      f"ckpt-{step}.index"))]
    return (f"node(s) {', '.join(f'node-{w}' for w in missing)} of the {count} that wrote "
            f"step {step} have no ckpt-{step}" if missing else None)


class NodeCheckpoints:
    """Saves this worker's node variables beside `main` (the chief's Checkpointer, or None
    on the other workers); `save` and `latest` as the controller calls them."""

    def __init__(self, directory: str, index: int, variables: list, keep: int, main=None,
                 count: int = 1):
        self.main = main
        self.index, self.count = index, count
        self.root = directory
        self.directory = os.path.join(directory, f"node-{index}")
        holder = tf.Module()
        holder.node = list(variables)
        self._nodes = tf.Variable(count, dtype=tf.int64, trainable=False, name="nodes")
        self._checkpoint = tf.train.Checkpoint(node=holder, nodes=self._nodes)
        self._manager = tf.train.CheckpointManager(self._checkpoint, self.directory,
                                                   max_to_keep=keep)

    @property
    def latest(self) -> str | None:
        return self.main.latest if self.main is not None else self._manager.latest_checkpoint

    def save(self, step: int) -> str:
        """Refuses (FileNotFoundError) if the logdir is gone: TensorFlow would recreate it,
        and the chief would then not see that it was lost (monitor.logdir_guard)."""
        logdir = os.path.dirname(os.path.normpath(self.root))
        if not os.path.isdir(logdir):
            raise FileNotFoundError(f"{logdir} is gone")
        self._manager.save(checkpoint_number=step)
        return self.main.save(step) if self.main is not None else self.latest

    def save_into(self, directory: str, step: int) -> str:
        """This node's checkpoint of `step` into another `<folder>/checkpoints` (a rescue)."""
        return tf.train.CheckpointManager(
            self._checkpoint, os.path.join(directory, f"node-{self.index}"), max_to_keep=1
        ).save(checkpoint_number=step)

    def restore(self, step: int, logdir: str, method=None, copies=()) -> str:
        """This node's state of `step` (the step the chief's checkpoint restored), by the
        module docstring's rule when the worker count changed; returns a log line's text.
        `method`: the run's aggregation, as the step holds it (its `rejoined`, which every
        wrapper hands to the method it wraps, and its capabilities' `resize_refusal`)."""
        own = os.path.join(self.directory, f"ckpt-{step}")
        first = os.path.join(self.root, "node-0", f"ckpt-{step}")
        if not tf.io.gfile.exists(first + ".index"):
            raise ConfigError(
                f"--logdir={logdir}: the checkpoint of step {step} has no {first} with the "
                "nodes' own state (error feedback, local copies); use a fresh --logdir")
        written = _written_by(self.root, step)
        refusal = method.capabilities.resize_refusal if method is not None else None
        if written != self.count and refusal:
            raise ConfigError(
                f"--logdir={logdir}: step {step} was written by {written} workers (nodes), "
                f"this run has {self.count}, and --aggregation={method.name} cannot re-deal "
                f"its nodes' state: {refusal}; resume with {written} workers")
        joins = self.index >= written
        self._checkpoint.restore(first if joins else own).assert_existing_objects_matched()
        self._nodes.assign(self.count)
        if joins and method is not None:
            method.rejoined(copies)
        if written == self.count:
            return ""
        return (f"node {self.index} joins: node 0's state of step {step}, own memory reset"
                if joins else f"node {self.index} keeps its state of step {step}") + (
                f" ({written} workers wrote it, {self.count} resume)")
