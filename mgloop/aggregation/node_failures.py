"""Node failures: simulated nodes that leave and return, with torchft's quorum semantics.

`--node_failures=SPEC` (one process, `--nodes=N`, the method at the nodes: nodes.py) says
which nodes are down on which steps: a comma-separated list of

    n@a-b    node n is down for the 0-based steps a <= s < b and returns at step b
    n@a      node n leaves at step a and does not return

e.g. `2@30-60,1@80`. L_s, the nodes live at step s, is a function of the step alone,
computed inside the compiled step from the step counter (`alive`, `weights`: one traced
graph for every step). What a step does with it, after torchft's Manager (PyTorch,
github.com/pytorch/torchft: `Manager.allreduce` zeroes a non-participating replica's
tensor and divides the sum by `num_participants()`; a replica that heals loads a healthy
peer's state dict before it takes part again):

- A down node computes nothing useful: its towers still run in the simulation, but what
  it sends is weighted 0 and its copies take no update (the step's guard,
  step/hooks/node_failures.py): their parameters, optimizer slots and the method's state
  stay frozen while it is down.
- Exact methods (`exact`: ring, collective, ps_*, ...): the method between nodes is
  handed w_n m_n, with w_n = [n in L_s] N / |L_s|, so its mean over N nodes is
      (1/N) sum_n w_n m_n = (1/|L_s|) sum_{n in L_s} m_n ,
  the mean over the live nodes (within float32 rounding: one product more per element).
- localsgd and DiLoCo (local_steps.py; Douillard et al. 2023, "DiLoCo: Distributed
  Low-Communication Training of Language Models", arXiv 2311.08105): a down node takes
  no inner step; a sync averages the live copies only, a = (1/|L_s|) sum_{n in L_s} v_n
  (the ring over w_n v_n), so DiLoCo's outer gradient is the mean of the live nodes'
  pseudo-gradients, x - a = (1/|L_s|) sum_{n in L_s} (x - v_n); a down node's copy,
  x and outer momentum do not change.
- A return at step b (recovery): at the end of step b - 1 every copy of the returning
  node takes, from the leader of the lowest-numbered node live at step b - 1, its
  trainable and non-trainable variables, every optimizer variable (slots and step count:
  torchft's DiLoCo example recovers the inner optimizer's state dict, not a fresh one)
  and the method's own state of that node (DiLoCo: x and the outer momentum). It takes
  part from step b on, as torchft's synchronous quorum (a healing replica takes part in
  the step it heals for); torchft's DiLoCo asks for a quorum once per period, so there a
  replica rejoins at a period's end: mgloop heals at the step given instead.

Node 0 never fails here: its copy is the template model that is saved, exported and
evaluated, and a checkpoint of an exact method holds it alone. So at least one node is
live on every step (torchft's quorum needs one replica). Compressors with error feedback,
robust aggregators and the streaming/sparse variants of local steps are refused
(`supported`): a zeroed input is not an excluded one for them.

Bytes. The simulated exchange still runs over all N nodes, a down node's part carrying
zeros, so the traffic counts (traffic.py) are those of the N-node exchange on every step:
on the steps with a node down, an upper bound on what travels (torchft re-forms the
group over the live replicas). The recovery is counted exactly, as what travels: each
return's state transfer on its own occasion, "node n returns" (the step b - 1).
"""

from __future__ import annotations

import dataclasses
import re

import tensorflow as tf
from absl import logging

from mgloop.aggregation.local_steps import DiLoCo, LocalSGD
from mgloop.aggregation.traffic import Occasion
from mgloop.errors import ConfigError
from mgloop.spec.variables import backing

EXAMPLE = "--node_failures=2@30-60,1@80 (node 2 down for steps [30, 60), node 1 from step 80)"
_ITEM = re.compile(r"^(\d+)@(\d+)(?:-(\d+))?$")
LOCAL = (LocalSGD, DiLoCo)  # exactly these classes: their subclasses sync otherwise


@dataclasses.dataclass(frozen=True)
class Outage:
    """Node `node` is down for the steps start <= s < end (end None: to the run's end)."""

    node: int
    start: int
    end: int | None

    def covers(self, step: int) -> bool:
        return self.start <= step and (self.end is None or step < self.end)

    def __str__(self) -> str:
        return f"{self.node}@{self.start}" + ("" if self.end is None else f"-{self.end}")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which of `nodes` nodes are down when: `outages`, at most one at a time per node."""

    nodes: int
    outages: tuple[Outage, ...]

    @staticmethod
    def parse(spec: str, nodes: int, train_steps: int) -> "Schedule":
        """The schedule of `spec`, or one ConfigError line naming the flag and an example."""
        outages = []
        for item in spec.split(","):
            match = _ITEM.match(item.strip())
            if not match:
                _refuse(spec, f"{item.strip()!r} is not n@a-b or n@a")
            node, start = int(match.group(1)), int(match.group(2))
            end = None if match.group(3) is None else int(match.group(3))
            if not 0 < node < nodes:
                _refuse(spec, f"node {node} is out of range: nodes 1..{nodes - 1} may fail "
                              "(node 0 holds the template model that is saved, exported and "
                              "evaluated)")
            if start >= train_steps or (end is not None and not start < end <= train_steps):
                _refuse(spec, f"{item.strip()} is out of range: steps a < b within "
                              f"[0, --train_steps={train_steps}]")
            outages.append(Outage(node, start, end))
        outages.sort(key=lambda o: (o.node, o.start))
        for earlier, later in zip(outages, outages[1:]):
            if earlier.node == later.node and (earlier.end is None or later.start < earlier.end):
                _refuse(spec, f"{earlier} and {later} overlap: a node's ranges must be "
                              "disjoint")
        return Schedule(nodes, tuple(outages))

    def live(self, node: int, step: int) -> bool:
        """Whether `node` takes part in step `step` (a Python int)."""
        return not any(o.node == node and o.covers(step) for o in self.outages)

    def fails(self, node: int) -> bool:
        return any(o.node == node for o in self.outages)

    def alive(self, node: int, step: tf.Tensor) -> tf.Tensor:
        """Whether `node` takes part in step `step` (the step counter: a tensor)."""
        down = tf.constant(False)
        for o in self.outages:
            if o.node == node:
                covers = step >= o.start if o.end is None else (step >= o.start) & (step < o.end)
                down = tf.logical_or(down, covers)
        return tf.logical_not(down)

    def weights(self, step: tf.Tensor, dtype) -> list[tf.Tensor]:
        """w_n = [n live] N / |L_s| for every node n (on the current device)."""
        live = [tf.cast(self.alive(n, step), dtype) for n in range(self.nodes)]
        scale = tf.cast(self.nodes, dtype) / tf.add_n(live)
        return [alive * scale for alive in live]

    def returns(self) -> list[tuple[int, int, int]]:
        """(node, step b it returns at, the node it recovers from: the lowest live at b-1)."""
        return [(o.node, o.end, min(n for n in range(self.nodes) if self.live(n, o.end - 1)))
                for o in self.outages if o.end is not None]

    def events(self) -> list[tuple[int, int, str]]:
        """(step, node, "leaves" | "returns") in step order."""
        out = [(o.start, o.node, "leaves") for o in self.outages]
        out += [(o.end, o.node, "returns") for o in self.outages if o.end is not None]
        return sorted(out)

    def as_records(self) -> list[dict]:
        """For summary.json: one record per outage."""
        return [{"node": o.node, "down_from": o.start, "returns_at": o.end}
                for o in self.outages]

    def logging_loop(self, train_loop, global_step):
        """`train_loop` that logs one line per leave (step a ran) or return (step b - 1 ran,
        its end healed the node) in the steps it ran."""
        def run(*args, **kwargs):
            first = int(global_step.numpy())
            result = train_loop(*args, **kwargs)
            last = int(global_step.numpy())
            for step, node, what in self.events():
                healed = what == "returns"  # at the end of step b - 1
                if first <= step - healed < last:
                    live = sum(self.live(n, step) for n in range(self.nodes))
                    logging.info("node %d %s at step %d (%d of %d nodes live)", node, what,
                                 step, live, self.nodes)
            return result
        return run


def _refuse(spec: str, reason: str):
    raise ConfigError(f"--node_failures={spec}: {reason}; e.g. {EXAMPLE}")


def rule(method) -> str | None:
    """How failures act on `method` (a class or an instance): "exact" (the live mean),
    "local" (localsgd, diloco: live copies averaged), None (refused)."""
    cls = method if isinstance(method, type) else type(method)
    if cls in LOCAL:
        return "local"
    if cls.exact and cls.exchanges and not cls.single_loss and not cls.copies_differ:
        return "exact"
    return None


def supported(names, get) -> str:
    return ", ".join(n for n in names() if rule(get(n)) is not None)


def check_settings(config, workers=None) -> Schedule | None:
    """The schedule of --node_failures, refused in one line where it does not apply."""
    spec = getattr(config, "node_failures", None)
    if not spec:
        return None
    from mgloop import aggregation as registry  # the registry imports this module's users
    from mgloop.aggregation import nodes as node_level
    if workers is not None and workers.num_workers > 1:
        raise ConfigError(f"--node_failures={spec} between {workers.num_workers} workers: "
                          "failures of real workers are the elastic launch's; use python -m "
                          "mgloop.launch --elastic")
    if not node_level.method_at_nodes(config):
        raise ConfigError(f"--node_failures={spec} needs simulated nodes with the method "
                          "between them: --nodes=N > 1 (and --method_at auto or nodes)")
    method = registry.parse(config.aggregation)[0]
    if rule(method) is None:
        raise ConfigError(f"--node_failures with --aggregation={config.aggregation}: a "
                          "down node is excluded only by exact methods and plain local "
                          "steps; use one of: " + supported(registry.names, registry.get))
    if config.grad_reduce != "mean":
        raise ConfigError(f"--node_failures={spec} with --grad_reduce={config.grad_reduce}: "
                          "the sum over a changing set of towers; use --grad_reduce=mean")
    return Schedule.parse(spec, config.nodes, config.train_steps)


# ---- inside the step: what NodeLevel (nodes.py) calls ----
def weighted(level, means: list[list[tf.Tensor]]) -> list[list[tf.Tensor]]:
    """Exact rule: w_n m_n on leader n (the method's mean over N is the live mean)."""
    out = []
    for n, values in enumerate(means):
        with tf.device(level.devices.towers[level.nodes.leader(n)]):
            w = level.failures.weights(level.step_counter, values[0].dtype)[n]
            out.append([tf.convert_to_tensor(v) * tf.cast(w, v.dtype) for v in values])
    return out


def recoveries(level, copies, after: list) -> list[tf.Tensor]:
    """A cond per return: at the end of step b - 1, the returning node's copies take the
    source node's state (parameters, optimizer, the method's per-node state)."""
    out = []
    for node, step, source in level.failures.returns():
        occasion = Occasion(f"node {node} returns", lambda s, b=step: s + 1 == b)

        def recover(node=node, source=source, occasion=occasion):
            with level.traffic.on(occasion):
                _copy_node(level, copies, source, node)
            return tf.constant(True)
        with tf.control_dependencies(after):
            out.append(tf.cond(tf.equal(level.step_counter + 1, step), recover,
                               lambda: tf.constant(False)))
        after = after + out[-1:]
    return out


def _copy_node(level, copies, source: int, node: int) -> None:
    def state(copy):
        return ([backing(v) for v in (*copy.trainable, *copy.non_trainable)]
                + [backing(v) for v in copy.optimizer.variables])
    first = level._copy_of(level.nodes.leader(source))
    origin = copies[first]
    values = [v.read_value() for v in state(origin)]
    targets = sorted({level._copy_of(t) for t in level.nodes.members(node)})
    for c in targets:
        for target, value in zip(state(copies[c]), values):
            target.assign(level.send(value, origin.device, target.device, exact=True))
    method_state = getattr(level.inner, "copy_state", lambda n: [])
    src_device = level.devices.towers[level.nodes.leader(source)]
    for target, variable in zip(method_state(node), method_state(source)):
        target.assign(level.send(variable.read_value(), src_device, target.device, exact=True))
