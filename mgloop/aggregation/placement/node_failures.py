"""Node failures: simulated nodes that leave and return, with torchft's quorum semantics.

`--node_failures=SPEC` (one process, `--nodes=N`, the method at the nodes: between_nodes.py) says
which nodes are down on which steps: a comma-separated list of

    n@a-b    node n is down for the 0-based steps a <= s < b and returns at step b
    n@a      node n leaves at step a and does not return

e.g. `2@30-60,1@80`. L_s, the nodes live at step s, is a function of the step alone,
read inside the compiled step from the step counter (`alive`, `set_index`: one traced
graph serves every step). What a step does with it follows torchft's Manager (PyTorch,
github.com/pytorch/torchft, manager.py: the quorum re-forms the process group over the
live replicas, `allreduce` divides the sum by `num_participants()`, and a replica that
heals loads a healthy peer's state dict before it takes part again):

- A down node computes nothing useful: its towers still run in the simulation, but it
  sends nothing and its copies take no update (the step's guard,
  step/hooks/node_failures.py): their parameters, optimizer slots and step count, the
  method's state of the node stay frozen while it is down.
- Exact methods (`exact`, `exchanges`: ring, collective, reduce_broadcast, ps_*, ...):
  the exchange runs among the live nodes only, the method made on their leaders
  (live_exchange.py), so every live copy gets
      g_s = (1/|L_s|) sum_{n in L_s} m_n ,
  the mean over the live nodes of their node means m_n (between_nodes.py, stage 1).
- localsgd, des_loc and DiLoCo (local_steps.py; Douillard et al. 2023, "DiLoCo: Distributed
  Low-Communication Training of Language Models", arXiv 2311.08105): a down node takes
  no inner step; a sync's ring runs among the live copies only,
      a = (1/|L_s|) sum_{n in L_s} v_n ,
  so DiLoCo's outer gradient is the mean of the live nodes' pseudo-gradients,
  x - a = (1/|L_s|) sum_{n in L_s} (x - v_n); a down node's copy, its x and outer
  momentum do not change (localsgd's warmup averages the live gradients so).
- A return at step b (recovery): at the end of step b - 1 every copy of the returning
  node takes, from the leader of the lowest-numbered node live at step b - 1, its
  trainable and non-trainable variables, every optimizer variable (slots and step count:
  torchft's train_diloco.py recovers the inner optimizer's state dict with the model and
  the outer optimizer, not a fresh one) and the method's own state of that node (DiLoCo:
  x and the outer momentum). It takes part from step b on, as with torchft's synchronous
  quorum (a healing replica takes part in the step it healed for). Where mgloop
  differs: torchft's DiLoCo asks for a quorum once per period, so there a replica
  rejoins only at a period's end; mgloop heals it at the step given, mid-period too (its
  pseudo-gradient then repeats the source's inner steps up to b, as torchft's comment
  "batches can be overrepresented" says of its own healing).

Node 0 never fails here: its copy is the template model that is saved, exported and
evaluated, and a checkpoint of an exact method holds it alone. So at least one node is
live on every step (torchft's quorum needs one replica). Compressors with error feedback,
robust aggregators, stale methods and the streaming/sparse variants of local steps are
refused (`rule`): their state is per node of all N, and a method on the live nodes only
would start it afresh.

Bytes: what travels. Each distinct live set has its own branch of the exchange, its
sends recorded on its own occasion ("nodes 0,1,3 live"; inside a sync "sync, nodes 0,1,3
live"), so the traffic of step s (traffic.py `at_step`) is the exchange among L_s: a
down node sends and receives nothing. A return's state transfer is counted on the
occasion "node n returns" (step b - 1), as the bytes it moves. Still counted as if every
node ran: the copy of a sync's result from a down node's leader to its other towers
(within the node), a shared layout's (ps_*) parameter reads by a down node's towers,
and the batch-norm statistics averaged over every tower
(non_trainable.py), which a down node's copies do not take. The step's logged loss and
metrics are every tower's, a down node's included.
"""

from __future__ import annotations

import bisect
import dataclasses
import re

import tensorflow as tf
from absl import logging

from mgloop.aggregation.local.des_loc import DesLoc
from mgloop.aggregation.local.local_steps import DiLoCo, LocalSGD
from mgloop.aggregation.traffic import EVERY_STEP, Occasion
from mgloop.errors import ConfigError
from mgloop.training.variables import backing

EXAMPLE = "--node_failures=2@30-60,1@80 (node 2 down for steps [30, 60), node 1 from step 80)"
_ITEM = re.compile(r"^(\d+)@(\d+)(?:-(\d+))?$")
LOCAL = (LocalSGD, DiLoCo, DesLoc)  # exactly these: their subclasses sync otherwise


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
    steps: int  # --train_steps

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
        schedule = Schedule(nodes, tuple(outages), train_steps)
        for start in schedule._bounds():  # the quorum needs one live node (kept by node 0)
            if not any(schedule.live(n, start) for n in range(nodes)):
                _refuse(spec, f"every node is down at step {start}: keep one live")
        return schedule

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

    def sets(self) -> list[tuple[int, ...]]:
        """The distinct sets of live nodes over the run's steps, in order of first use."""
        out = []
        for start in self._bounds():
            live = tuple(n for n in range(self.nodes) if self.live(n, start))
            if live not in out:
                out.append(live)
        return out

    def set_index(self, step):
        """The index in `sets()` of L_s: a Python int for an int, a tensor for a tensor."""
        bounds, sets = self._bounds(), self.sets()
        table = [sets.index(tuple(n for n in range(self.nodes) if self.live(n, b)))
                 for b in bounds]
        if isinstance(step, int):
            return table[bisect.bisect_right(bounds, step) - 1]
        segment = tf.searchsorted(tf.constant(bounds, tf.int64),
                                  tf.reshape(tf.cast(step, tf.int64), [1]), side="right")[0]
        return tf.gather(tf.constant(table, tf.int32), tf.cast(segment, tf.int32) - 1)

    def _bounds(self) -> list[int]:
        """0 and every step where some node leaves or returns (before the run's end)."""
        edges = {0} | {o.start for o in self.outages} | {o.end for o in self.outages
                                                           if o.end is not None}
        return sorted(b for b in edges if b < self.steps)

    def occasion(self, k: int, outer: Occasion | None = None) -> Occasion:
        """The steps with the k-th set live (and, inside `outer`, `outer`'s steps too)."""
        name = "nodes " + ",".join(map(str, self.sets()[k])) + " live"
        if outer is None or outer.name == EVERY_STEP.name:
            return Occasion(name, lambda s: self.set_index(s) == k)
        return Occasion(f"{outer.name}, {name}",
                        lambda s: outer.occurs(s) & (self.set_index(s) == k),
                        outer.overlap_steps)

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
    if (c := method.capabilities).exact and c.exchanges and not (c.single_loss or c.copies_differ):
        return "exact"
    return None


def supported(names, get) -> str:
    return ", ".join(n for n in names() if rule(get(n)) is not None)


def check_schedule(options, train_steps: int, context) -> Schedule | None:
    """The schedule of --node_failures (ExchangeOptions `options`, over --train_steps),
    refused in one line where it does not apply on the run of `context` (settings.Context);
    with its DeviceRequest, the method is checked on every live set too."""
    spec = options.node_failures
    if spec is None:
        return None
    if not spec.strip():  # the flag's default is None (not set); an empty value is a slip
        raise ConfigError(f"--node_failures is set but empty; give n@a-b or n@a items, e.g. "
                          f"{EXAMPLE}, or leave --node_failures out for no failures")
    from mgloop import aggregation  # the registry imports this module's users
    from mgloop.aggregation.node_settings import method_at_nodes
    if context.num_workers > 1:
        raise ConfigError(f"--node_failures={spec} between {context.num_workers} workers: "
                          "failures of real workers are the elastic launch's; use python -m "
                          "mgloop.launch --elastic")
    if not method_at_nodes(options):
        raise ConfigError(f"--node_failures={spec} needs simulated nodes with the method "
                          "between them: --nodes=N > 1 (and --method_at auto or nodes)")
    method, method_options = aggregation.parse(options.aggregation)
    if rule(method) is None:
        raise ConfigError(f"--node_failures with --aggregation={options.aggregation}: a "
                          "down node is excluded only by exact methods and plain local "
                          "steps; use one of: " + supported(aggregation.names, aggregation.get))
    if options.grad_reduce != "mean":
        raise ConfigError(f"--node_failures={spec} with --grad_reduce={options.grad_reduce}: "
                          "the sum over a changing set of towers; use --grad_reduce=mean")
    schedule = Schedule.parse(spec, options.nodes, train_steps)
    request = context.request
    if request is not None and rule(method) == "exact":  # the method on each live set
        per_node = request.num_towers // options.nodes
        for live in schedule.sets():
            leaders = tuple(request.indices[n * per_node // request.towers_per_device]
                            for n in live)
            try:
                method.check(dataclasses.replace(request, indices=leaders, towers_per_device=1),
                             method_options)
            except ConfigError as error:
                raise ConfigError(f"--node_failures={spec}: with nodes {live} live, "
                                  f"{error}") from None
    return schedule


def schedule_of(options, train_steps: int) -> Schedule | None:
    """The schedule of a checked --node_failures (`check_schedule`), or None."""
    spec = options.node_failures
    return Schedule.parse(spec, options.nodes, train_steps) if spec else None


# ---- inside the step: what NodeLevel (between_nodes.py) calls ----
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
