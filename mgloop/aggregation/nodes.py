"""Nodes: the method under study between simulated nodes, an exact sum within each.

A run has N nodes of T_n = T/N towers each, contiguous and node-major (node n holds
towers n T_n .. (n+1) T_n - 1, as workers hold theirs); `--nodes=N` splits one
process's towers so. With `--method_at=nodes` (the default when N > 1) a step's
exchange has three stages:

    1. within node n, onto its leader (tower n T_n):
           s_n[v] = sum_{t in n} g[t][v]          by `--within_node`: `reduce` sends every
                                                 tower's gradient to the leader, which adds
                                                 them in tower order (K towers per device:
                                                 each device adds its own first, sending one
                                                 sum: device_groups.node_sum); an exact
                                                 method's name runs it on the node's towers
           m_n[v] = s_n[v] / T_n                  the node's exact mean
    2. between the nodes: the method under study, made on the N leaders as its towers,
           out_n = method.reduce([m_0 .. m_{N-1}])   on leader n (or its shared copy)
       so every compressor, its error feedback, local steps, staleness, dropping and every
       robust aggregator act on one gradient per node, with their state per node.
    3. within node n: out_n sent from the leader to the node's other towers.

With equal shards, (1/N) sum_n m_n = (1/T) sum_t g[t]: an exact method gives every
tower's mean (within float32 rounding of the two-stage sum), a lossy one its own output
on N node gradients, exactly what it gives N towers that each compute a node's shard.
`--grad_reduce=sum`: the method still sees node means; its output is multiplied by T.
A method whose copies differ between synchronisations (local SGD, DiLoCo) keeps one copy
per node: after its synchronisation (its `due()`) every tower of node n takes the
leader's parameters and optimizer slots (3. again, counted the same way).

`--method_at=towers` keeps the method over every tower; N then only says which sends
cross a node boundary. Either way every send is counted within or between nodes
(traffic.py), the host CPU counting as node 0's.

With `--node_failures` some nodes are down on some steps (node_failures.py: torchft's
quorum): the exchange runs among the live nodes only (live_exchange.py), a down node's
copies are frozen (the step's guard) and a returning node takes a live node's state at
the end of the step before it returns (`after_update`).

The topology itself (`Nodes`: which towers a node holds, its leader) is cluster/nodes.py.
"""

from __future__ import annotations


import tensorflow as tf

from mgloop import aggregation as registry
from mgloop.aggregation import device_groups
from mgloop.aggregation import live_exchange, local_steps
from mgloop.aggregation import node_failures
from mgloop.aggregation.base import SHARED, Aggregation, canonical
from mgloop.aggregation.peers import Peers
from mgloop.aggregation.traffic import Occasion
from mgloop.aggregation.wrapper import Wrapper
from mgloop.cluster.devices import DeviceSet
from mgloop.cluster.nodes import Nodes
from mgloop.spec.variables import backing

from mgloop.aggregation.exchange_options import DIRECT, METHOD_AT  # noqa: F401


class NodeLevel(Wrapper):
    """`method` (made on the node leaders) between nodes; `within` (an exact method's name,
    or DIRECT) inside each node."""

    def __init__(self, method: Aggregation, devices: DeviceSet, nodes: Nodes,
                 within: str = DIRECT, make=None, failures=None, live_methods=None):
        super().__init__(method, devices)
        self.nodes, self.within_name = nodes, within
        self.failures = failures  # node_failures.Schedule: nodes down on some steps, or None
        self.live_methods = live_methods or {}  # {live nodes: the method on their leaders}
        for live_method in self.live_methods.values():
            live_method.traffic = self.traffic
        if failures is not None and node_failures.rule(method) == "local":
            method.live = failures  # its syncs average the live copies only
        self.sums_at_home = False  # stage 1 always runs first
        self.traffic.node_of.update(nodes.device_map())  # one set of counts, split by tier
        self.within = []
        if within != DIRECT:
            for n in range(nodes.count):
                stage = make(within, DeviceSet(tuple(devices.towers[t] for t in nodes.members(n)),
                                               devices.host, devices.simulated),
                             method.transport_dtype.name)
                stage.traffic = self.traffic
                self.within.append(stage)

    # ---- what the step sees: every tower, the method's copies (Wrapper.parameter_devices) ----
    def _copy_of(self, tower: int) -> int:
        """The index of the copy tower `tower` reads (its device's)."""
        return tower // self.devices.towers_per_device

    def _device_firsts(self) -> list[int]:
        """The first tower of every device, in order (one per copy)."""
        return list(range(0, self.num_towers, self.devices.towers_per_device))

    @property
    def exchanges_between_workers(self) -> bool:
        """True: the method itself moves values between the worker processes (peers.py),
        so the cross-worker stage adds only the step's metrics."""
        return self.inner.peers is not None

    @property
    def all_towers(self) -> int:
        """T over every node of the run (every worker's with peers)."""
        return self.inner.num_towers * self.nodes.per_node

    def tower_values(self, tower, values):
        return self.inner.tower_values(self.inner.tower_offset + self.nodes.node_of_tower(tower),
                                       values)

    # ---- the three stages ----
    def build(self, variables):
        super().build(variables)
        for method in self.live_methods.values():  # node failures: an exact method's copies
            method.step_counter = self.step_counter
            method.build(variables)

    def node_means(self, tower_values, variables, nodes=None) -> list[list[tf.Tensor]]:
        """Stage 1: m_n on leader n, per node (of `nodes`; None: every node)."""
        towers, means = self.devices.towers, []
        for n in range(self.nodes.count) if nodes is None else nodes:
            members = self.nodes.members(n)
            leader = towers[self.nodes.leader(n)]
            if self.within_name == DIRECT:
                sums = [self._sum_on(leader, [tower_values[t][i] for t in members],
                                     [towers[t] for t in members])
                        for i in range(len(variables))]
            else:
                sums = self.within[n].reduce([tower_values[t] for t in members], variables,
                                             average=False)[0]
            if self.nodes.per_node == 1:  # one tower per node: its gradient is the mean
                means.append(list(sums))
                continue
            with tf.device(leader):
                means.append([tf.convert_to_tensor(s) * (1.0 / self.nodes.per_node)
                              for s in sums])
        return means

    def _sum_on(self, leader, values, sources):
        """A node's towers' sum on its leader: added in tower order; with K towers per
        device, per device first, in an order Grappler keeps (device_groups.node_sum)."""
        if self.devices.towers_per_device == 1:
            return self.sum_on(leader, values, sources)
        return device_groups.node_sum(self, leader, values, sources)

    def reduce(self, tower_values, variables, average=True):
        if self.failures is not None and node_failures.rule(self.inner) == "exact":
            return live_exchange.exact_reduce(self, tower_values, variables)  # among the live
        out = self.inner.reduce(self.node_means(tower_values, variables), variables, True)
        if not average:  # the sum over every tower
            out = [[self._times(value, copy) for value in values]
                   for values, copy in zip(out, self.inner.parameter_devices())]
        if self.layout == SHARED:
            return out
        return [self._from_leader(out, t) for t in self._device_firsts()]

    def _times(self, value, device):
        with tf.device(device):
            return value * tf.cast(self.all_towers, value.dtype)

    def _from_leader(self, out, tower: int) -> list[tf.Tensor]:
        """Stage 3: node n's output (on its leader) on tower `tower` of node n."""
        node = self.nodes.node_of_tower(tower)
        leader = self.devices.towers[self.nodes.leader(node)]
        return [self.send(value, leader, self.devices.towers[tower]) for value in out[node]]

    def after_update(self, copies):
        ops = self._after_update(copies)
        if self.failures is None or self.layout == SHARED:
            return ops
        return ops + node_failures.recoveries(self, copies, ops)  # returning nodes heal

    def _after_update(self, copies):
        if self.layout == SHARED:
            return self.inner.after_update(copies)
        leaders = [copies[self._copy_of(self.nodes.leader(n))] for n in range(self.nodes.count)]
        ops = self.inner.after_update(leaders)
        if not self.copies_differ or self.nodes.per_node == 1:
            return ops

        syncs = self.inner.syncs()
        if not syncs:  # a method with its own copies but no declared syncs: every step
            with tf.control_dependencies(ops):
                self._leaders_to_members(copies, None, True)
                return [tf.constant(True)]
        handed = []
        with tf.control_dependencies(ops):
            for sync in syncs:
                def propagate(sync=sync):
                    occasion = Occasion(f"{sync.occasion.name} within nodes",
                                        sync.occasion.occurs)
                    with self.traffic.on(occasion):
                        self._leaders_to_members(copies, sync.variables, sync.slots)
                    return tf.constant(True)
                handed.append(tf.cond(sync.due(), propagate, lambda: tf.constant(False)))
        return handed

    def _leaders_to_members(self, copies, indices, slots: bool) -> None:
        """Every copy of node n (one per device it holds) takes its leader's trainable
        variables `indices` (None: all) and, with `slots`, optimizer slots. Between syncs
        the copies of a node apply the same node-mean update to the same values, so they
        differ only in what a sync changed."""

        def chosen(copy):
            trainable = list(copy.trainable)
            picked = trainable if indices is None else [trainable[i] for i in indices]
            return picked + (local_steps.slot_variables(copy.optimizer) if slots else [])
        for n in range(self.nodes.count):
            first = self._copy_of(self.nodes.leader(n))
            leader = copies[first]
            sources = chosen(leader)
            values = [backing(v).read_value() for v in sources]
            for c in sorted({self._copy_of(t) for t in self.nodes.members(n)} - {first}):
                copy = copies[c]
                targets = chosen(copy)
                for target, value in zip(targets, values):
                    target = backing(target)
                    target.assign(self.send(value, leader.device, target.device, exact=True))


def settings_of(config) -> tuple[int, str, str]:
    """(--nodes, --method_at, --within_node) of a Config, or of any object with the
    aggregation's fields (defaults where it has none)."""
    return (getattr(config, "nodes", 1), getattr(config, "method_at", "auto"),
            getattr(config, "within_node", DIRECT))


def method_at_nodes(config, num_workers: int = 1) -> bool:
    """Whether `config` puts the method between nodes: N > 1 simulated nodes in one
    process, or several workers (each a node) with --method_at=nodes, or with auto for a
    method that is not exact (an exact one's local stage inside each worker and the one
    collective between them, cross_worker.py, already sum within and then between nodes)."""
    nodes, method_at, _ = settings_of(config)
    if num_workers <= 1:
        return nodes > 1 and method_at in ("auto", "nodes")
    if method_at == "auto":
        method = registry.get(config.aggregation)
        return (not method.exact and method.exchanges and not method.single_loss
                and method.runs_between_processes)
    return method_at == "nodes"


def make(config, devices: DeviceSet, make_method, workers=None) -> Aggregation:
    """The run's aggregation: the method on the node leaders inside a NodeLevel when the
    method is at the nodes, else on every tower (its traffic split by node all the same).
    Several workers at the nodes: this process is one node; the method is made on its
    leader with `peers` (peers.py), so its transport runs between the processes."""
    num_workers = workers.num_workers if workers is not None else 1

    def make_method(spec, devices, transport_dtype, make=make_method):
        method = make(spec, devices, transport_dtype)
        if method.buckets_payloads:  # its gathered payloads travel in buckets
            method.bucket_bytes = getattr(config, "pack_bytes", 0)
        return method
    if num_workers > 1 and method_at_nodes(config, num_workers):
        nodes = Nodes(tuple(devices.towers), 1, devices.host)
        leader = DeviceSet((devices.towers[0],), devices.host, devices.simulated)
        method = make_method(config.aggregation, leader, config.transport_dtype)
        method.peers = Peers.make(workers, method.parameter_devices()[0])
        level = NodeLevel(method, devices, nodes, settings_of(config)[2], make_method)
        level.traffic.node_of.update({canonical(d): workers.index for d in
                                      (devices.host, *devices.towers)})
        return level
    nodes = Nodes(tuple(devices.towers), max(settings_of(config)[0], 1), devices.host)
    if not method_at_nodes(config):
        if len(devices.copy_devices) < devices.num_towers:  # K towers per device
            method = device_groups.make(config.aggregation, devices, config.transport_dtype,
                                        make_method, getattr(config, "pack_bytes", 0))
        else:
            method = make_method(config.aggregation, devices, config.transport_dtype)
        method.traffic.node_of.update(nodes.device_map())
        return method
    leaders = DeviceSet(tuple(devices.towers[nodes.leader(n)] for n in range(nodes.count)),
                        devices.host, devices.simulated)
    method = make_method(config.aggregation, leaders, config.transport_dtype)
    failures = node_failures.check_settings(config)
    live = (live_exchange.make_live_methods(failures, make_method, config, leaders.towers,
                                            leaders)
            if failures is not None and node_failures.rule(method) == "exact" else None)
    return NodeLevel(method, devices, nodes, settings_of(config)[2], make_method, failures, live)
