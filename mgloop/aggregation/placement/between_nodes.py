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

The topology itself (`Nodes`: which towers a node holds, its leader) is cluster/node_layout.py.
"""

from __future__ import annotations

import inspect

import tensorflow as tf

from mgloop import aggregation
from mgloop.aggregation.base import SHARED, Aggregation
from mgloop.aggregation.exchange_options import DIRECT, ExchangeOptions
from mgloop.aggregation.local import local_steps
from mgloop.aggregation.node_settings import method_at_nodes
from mgloop.aggregation.placement import device_groups
from mgloop.aggregation.placement import live_exchange
from mgloop.aggregation.placement import node_failures
from mgloop.aggregation.placement.wrapper import Wrapper
from mgloop.aggregation.traffic import Occasion
from mgloop.cluster.devices import DeviceSet
from mgloop.cluster.node_layout import Nodes
from mgloop.training.variables import backing


class NodeLevel(Wrapper):
    """`method` (made on the node leaders) between nodes; `within` (an exact method's name,
    or DIRECT) inside each node, made with `make(spec, DeviceSet, dtype, traffic=...)`.
    `failures`: node_failures.Schedule (nodes down on some steps) or None, and
    `live_methods` {live nodes: the method on their leaders} (made with this traffic and
    `method`'s step counter, as `make` makes them).
    `cluster`: the workers, each one node (this process is node `cluster.index`)."""

    def __init__(self, method: Aggregation, devices: DeviceSet, nodes: Nodes,
                 within: str = DIRECT, make=None, failures=None, live_methods=None,
                 cluster=None):
        super().__init__(method, devices, cluster)
        self.nodes, self.within_name = nodes, within
        self.failures, self.live_methods = failures, live_methods or {}
        self.capabilities = self.capabilities.but(sums_at_home=False)  # stage 1 runs first
        first = cluster.index if cluster is not None else 0  # one set of counts, by tier
        self.traffic.node_of.update({d: first + n for d, n in nodes.device_map().items()})
        self.within = [] if within == DIRECT else [
            make(within, DeviceSet(tuple(devices.towers[t] for t in nodes.members(n)),
                                   devices.host, devices.simulated),
                 method.transport_dtype.name, traffic=self.traffic)
            for n in range(nodes.count)]

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

    def towers_per_node(self) -> int:
        return self.nodes.per_node

    def failure_schedule(self):
        return self.failures

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
        if self.capabilities.layout == SHARED:
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
        if self.failures is None or self.capabilities.layout == SHARED:
            return ops
        return ops + node_failures.recoveries(self, copies, ops)  # returning nodes heal

    def _after_update(self, copies):
        if self.capabilities.layout == SHARED:
            return self.inner.after_update(copies)
        leaders = [copies[self._copy_of(self.nodes.leader(n))] for n in range(self.nodes.count)]
        ops = self.inner.after_update(leaders)
        if not self.capabilities.copies_differ or self.nodes.per_node == 1:
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

    def rejoined(self, copies) -> None:
        """A joining node (runs/node_checkpoint.py): the method's rule on the node leaders'
        copies (the ones it holds), then, for a method whose copies differ, every other copy
        of the node takes its leader's trainable values, as after a sync (a restore, not a
        step: nothing is counted as sent)."""
        leaders = [copies[self._copy_of(self.nodes.leader(n))] for n in range(self.nodes.count)]
        self.inner.rejoined(leaders)
        if not self.capabilities.copies_differ or self.nodes.per_node == 1:
            return
        for n, leader in enumerate(leaders):
            members = {self._copy_of(t) for t in self.nodes.members(n)}
            for c in sorted(members - {self._copy_of(self.nodes.leader(n))}):
                for target, source in zip(copies[c].trainable, leader.trainable):
                    with tf.device(copies[c].device):
                        backing(target).assign(tf.identity(backing(source).read_value()))

    def global_model(self, copies):
        """The method's model of the copies it holds (`node_copies`)."""
        return self.inner.global_model(self.node_copies(copies))

    def node_copies(self, copies):
        """The leaders' copies (a node's others equal its leader's), or the shared one."""
        return list(copies) if self.capabilities.layout == SHARED else [
            copies[self._copy_of(self.nodes.leader(n))] for n in range(self.nodes.count)]

    def _leaders_to_members(self, copies, indices, slots: bool) -> None:
        """Every copy of node n (one per device it holds) takes its leader's trainable
        variables `indices` (None: all) and, with `slots`, optimizer slots. Between syncs
        the copies of a node apply the same node-mean update to the same values, so they
        differ only in what a sync changed."""

        def chosen(copy):
            trainable = list(copy.trainable)
            picked = trainable if indices is None else [trainable[i] for i in indices]
            return picked + (local_steps.slot_variables(copy.optimizer, slots) if slots else [])
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


def make(options: ExchangeOptions, devices: DeviceSet, make_method, workers=None,
         failures=None, step_counter=None) -> Aggregation:
    """The run's aggregation for the exchange `options`: the method on the node leaders
    inside a NodeLevel when the method is at the nodes, else on every tower (its traffic
    split by node all the same); with several workers, inside the cross-worker stage.
    Several workers at the nodes: this process is one node; the method is made on its
    leader between the workers (its `peers`, peers.py), so its transport runs between the
    processes. `make_method(spec, DeviceSet, dtype, **construction)`: registry.make;
    `failures`: the --node_failures schedule (node_failures.schedule_of), or None;
    `step_counter`: the global step (global_step_on), given to every method that takes it
    (the wrappers take their inner method's; a method whose `__init__` takes no counter
    makes its own: base.py `step_counter`)."""
    if workers is not None and workers.num_workers > 1:
        from mgloop.aggregation.placement.cross_worker import CrossWorker, ShardedCrossWorker
        local = _made(options, devices, make_method, workers, failures, step_counter)
        # (validation let --shard_update through only for a method that splits its all-reduce)
        return (ShardedCrossWorker if options.shard_update else CrossWorker)(local, workers)
    return _made(options, devices, make_method, None, failures, step_counter)


def _takes(method: type[Aggregation], keyword: str) -> bool:
    """Whether `method(...)` accepts `keyword`: Aggregation's `__init__` does, and so does
    every one that passes its other keywords on; a plugin's fixed `__init__` may not."""
    parameters = inspect.signature(method.__init__).parameters.values()
    return any(p.name == keyword or p.kind is p.VAR_KEYWORD for p in parameters)


def _made(options, devices, make_method, workers, failures, step_counter) -> Aggregation:
    """`make`'s method inside one process (with `workers`: this worker's stage)."""
    spec, dtype = options.aggregation, options.transport_dtype

    def made(spec, devices, transport_dtype, **construction):
        method = aggregation.get(spec)
        if method.capabilities.buckets_payloads:  # its gathered payloads travel in buckets
            construction["bucket_bytes"] = options.pack_bytes
        if step_counter is not None and _takes(method, "step_counter"):
            construction["step_counter"] = step_counter
        return make_method(spec, devices, transport_dtype, **construction)
    if workers is not None and method_at_nodes(options, workers.num_workers):
        nodes = Nodes(tuple(devices.towers), 1, devices.host)
        leader = DeviceSet((devices.towers[0],), devices.host, devices.simulated)
        method = made(spec, leader, dtype, between_workers=workers)
        return NodeLevel(method, devices, nodes, options.within_node, made, cluster=workers)
    nodes = Nodes(tuple(devices.towers), max(options.nodes, 1), devices.host)
    if not method_at_nodes(options):
        at_workers = {} if workers is None else {"cluster": workers}
        if len(devices.copy_devices) < devices.num_towers:  # K towers per device
            method = device_groups.make(spec, devices, dtype, made, options.pack_bytes,
                                        workers)
        else:
            method = made(spec, devices, dtype, **at_workers)
        method.traffic.node_of.update(nodes.device_map())
        return method
    leaders = DeviceSet(tuple(devices.towers[nodes.leader(n)] for n in range(nodes.count)),
                        devices.host, devices.simulated)
    rule = node_failures.rule(aggregation.get(spec)) if failures is not None else None
    method = made(spec, leaders, dtype, **({"live": failures} if rule == "local" else {}))
    live = (live_exchange.make_live_methods(failures, made, spec, dtype, leaders.towers,
                                            leaders, method.traffic)
            if rule == "exact" else None)
    return NodeLevel(method, devices, nodes, options.within_node, made, failures, live)
