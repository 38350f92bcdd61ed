"""What a run moves and would take per step: its traffic averaged over its steps, and the
link model of it (summary.json's "link_model", TensorBoard's link/ scalars, a study's
curves: one definition for all of them).

A traced step counts everything the step may send (aggregation/traffic.py), each part on
the occasion it is sent on (every step; a sync every H steps; one fragment of Streaming
DiLoCo's schedule; a warmup). Step s moves the parts whose occasion occurs at s
(`Traffic.at_step`). Over the run's steps s = 0 .. S-1 (S = its final step):

    bytes per step (device d)   = (1/S) sum_s bytes_d(s) = sum_o (n_o / S) bytes_d(o)
    exchange seconds per step   = (1/S) sum_s X(s)         X: link_model.py's time of one
                                                           step's traffic on a link
    step seconds, no overlap    = C + (1/S) sum_s X(s)     C: the compute per step, measured
                                                           or modelled (hardware.py, --compute)
    step seconds, overlap       = (1/S) sum_s [max(C, X_0(s)) + sum_o max(0, X_o - k_o C)]

n_o the steps on which occasion o occurs. In the overlap figure X_0(s) is the time of step
s's traffic but that of its occasions o with `overlap_steps` k_o > 0 (traffic.py: an
exchange whose result is used k_o steps later, Streaming DiLoCo's tau or eager updates),
and X_o the time of o's traffic alone: such an exchange may run behind the compute of
the k_o steps that follow, so it costs only what exceeds k_o C (0 when it fits), and
each one apart (the steps it overlaps may have exchanges of their own: not modelled).
With no such occasion it is (1/S) sum_s max(C, X(s)). The busiest device is taken on the averages
(max_d of the mean, as the bandwidth term of a long run sees it). A method that sends on
every step has S-independent figures, those of its traced step exactly.

Where the method acts. With N > 1 nodes (--nodes or workers), the method's gradients
cross between nodes: the figures at "the method's tier" are the between tier's, else the
within tier's (one node: every device's). The compression ratio is of the gradients only:

    compression_ratio = dense / G       dense: the bytes per participant of a float32 ring
                                        all-reduce of the trainable gradients among the N
                                        nodes (or T towers with one node), 2(P-1)/P of them;
                                        G: the busiest device's gradient bytes per step at
                                        the method's tier

Bytes a step counts only when it runs (a payload whose length the data decides:
aggregation/measured.py) enter as their run's mean per step, total / n_o: `steps` must be
the steps the run trained (its final step), and a per-step figure (the slowest step, the
bytes through step p) takes that mean for each of its steps.

State (batch-norm statistics, the step's metrics) is reported apart, never in G. Per sync
("syncs": one entry per occasion that is not every step): the bytes and messages of one
occurrence, how many times it occurred, and the ratio dense / its gradient bytes.
"""

from __future__ import annotations

import collections
from typing import Callable

from mgloop.aggregation.traffic import Traffic
from mgloop.observe import hardware
from mgloop.observe import link_model


class Schedule:
    """Which occasions occur on each of a run's steps 0 .. `steps`-1 (read once), and
    figures of the traffic averaged or summed over them (one Traffic per distinct set of
    occasions)."""

    def __init__(self, traffic: Traffic, steps: int):
        self.steps = max(int(steps), 0)
        shared: dict[tuple, tuple] = {}  # one tuple per distinct set: a pointer per step
        self.keys = [shared.setdefault(key, key)
                     for key in map(traffic.occurring, range(self.steps))]
        self.counts = collections.Counter(self.keys)
        # bytes counted when the steps ran (aggregation/measured.py): their mean per step
        self.traffic = traffic.with_measured(lambda name: sum(
            count for key, count in self.counts.items() if name in key))
        self._of_key: dict[tuple, Traffic] = {}

    def traffic_of(self, key: tuple[str, ...]) -> Traffic:
        """What a step with the occasions `key` moves (Traffic.of_occasions, kept)."""
        if key not in self._of_key:
            self._of_key[key] = self.traffic.of_occasions(key)
        return self._of_key[key]

    def mean_traffic(self) -> Traffic:
        """The counts per step averaged over the steps (every part and tier)."""
        mean = Traffic(node_of=dict(self.traffic.node_of))
        for key, count in self.counts.items():
            mean.add_scaled(self.traffic_of(key), count / self.steps)
        return mean

    def mean(self, figure: Callable[[Traffic], float]) -> float:
        """(1/S) sum_s figure(traffic of step s); 0 with no step."""
        if not self.steps:
            return 0.0
        return sum(count * figure(self.traffic_of(key))
                   for key, count in self.counts.items()) / self.steps

    def overlap_steps(self, name: str) -> int:
        """The occasion `name`'s overlap_steps (traffic.py)."""
        return self.traffic.by_occasion[name][0].overlap_steps

    def mean_overlapped(self, exchange: Callable[[Traffic], float], compute: float) -> float:
        """(1/S) sum_s of the step with overlap (the module's top): max(C, X_0(s)) plus
        max(0, X_o - k_o C) for each overlapped occasion o of step s; 0 with no step."""
        if not self.steps:
            return 0.0
        total = 0.0
        for key, count in self.counts.items():
            hidden = [name for name in key if self.overlap_steps(name) > 0]
            plain = tuple(name for name in key if name not in hidden)
            seconds = max(compute, exchange(self.traffic_of(plain)))
            for name in hidden:
                seconds += max(0.0, exchange(self.traffic_of((name,)))
                               - self.overlap_steps(name) * compute)
            total += count * seconds
        return total / self.steps

    def slowest(self, figure: Callable[[Traffic], float]) -> float:
        """max_s figure(traffic of step s); 0 with no step."""
        return max((figure(self.traffic_of(key)) for key in self.counts), default=0.0)

    def occurrences(self, name: str) -> int:
        return sum(count for key, count in self.counts.items() if name in key)

    def _counts_through(self, points):
        """(p, how many of the steps 0 .. p-1 had each set of occasions) for each step
        count p in `points` (at most `steps`), in order."""
        counts, step = collections.Counter(), 0
        for point in sorted(set(points)):
            counts.update(self.keys[step:point])
            step = max(step, point)
            yield point, counts

    def traffic_through(self, points) -> dict[int, Traffic]:
        """{p: the counts summed over steps 0 .. p-1} for each step count p in `points`."""
        out = {}
        for point, counts in self._counts_through(points):
            total = Traffic(node_of=dict(self.traffic.node_of))
            for key, count in counts.items():
                total.add_scaled(self.traffic_of(key), count)
            out[point] = total
        return out

    def totals(self, points, figure: Callable[[Traffic], float]) -> dict[int, float]:
        """{p: sum_{s < p} figure(traffic of step s)} for each step count p in `points`
        (a study's curve: exchange seconds through each eval)."""
        return {point: sum(count * figure(self.traffic_of(key)) for key, count in counts.items())
                for point, counts in self._counts_through(points)}


def method_tier(num_nodes: int) -> str:
    """Where the method's gradients travel: between nodes when there are several."""
    return "between" if num_nodes > 1 else "within"


def busiest_bytes(traffic: Traffic, tier: str, kind: str) -> float:
    """The busiest device's bytes, max(sent, received), of one (tier, kind) part."""
    return traffic.parts.get((tier, kind), Traffic()).busiest()[0]


def dense_bytes(gradient_bytes: int | None, num_towers: int, num_nodes: int) -> int | None:
    """A float32 ring all-reduce's bytes per participant among the nodes (or the towers of
    one node), `link_model.dense_ring_bytes`; None with one participant."""
    participants = num_nodes if num_nodes > 1 else num_towers
    if gradient_bytes is None or participants <= 1:
        return None
    return link_model.dense_ring_bytes(gradient_bytes, participants)


def _ratio(dense, counted):
    return dense / counted if dense and counted else None


def _tiers(mean: Traffic, gradient_bytes, num_nodes: int) -> dict:
    """Per tier and kind, the busiest device's bytes and messages per step and the bytes
    all devices send per step; the between tier's dense bytes and compression ratio."""
    out = mean.tiers_as_dict()
    dense = (link_model.dense_ring_bytes(gradient_bytes, num_nodes)
             if gradient_bytes is not None and num_nodes > 1 else None)
    out["nodes"] = num_nodes
    out["dense_ring_bytes_between"] = dense
    out["compression_ratio_between"] = _ratio(dense, out["between"]["gradient"]["bytes_per_device"])
    return out


def _syncs(schedule: Schedule, tier: str, dense) -> dict:
    """One entry per occasion other than every step: one occurrence's figures."""
    out = {}
    for occasion in schedule.traffic.occasions():
        if occasion.name == "every step":
            continue
        one = schedule.traffic.of_occasion(occasion.name)
        gradient = busiest_bytes(one, tier, "gradient")
        num_bytes, messages = one.busiest()
        out[occasion.name] = {"occurrences": schedule.occurrences(occasion.name),
                              "bytes_per_device": num_bytes, "messages_per_device": messages,
                              "gradient_bytes_per_device": gradient,
                              "state_bytes_per_device": busiest_bytes(one, tier, "state"),
                              "compression_ratio": _ratio(dense, gradient)}
    return out


def exchange_of(link, within) -> Callable[[Traffic], float]:
    """X(traffic) on `link`: the two-tier model with `within` for a between link."""
    if link.tier == "between":
        return lambda traffic: link_model.tiered_exchange_seconds(traffic, within, link)
    return lambda traffic: link_model.exchange_seconds(traffic, link)


def report(schedule: Schedule, links, compute: float | None,
           gradient_bytes: int | None = None, num_towers: int = 1, num_nodes: int = 1,
           compute_of: hardware.Compute | None = None) -> dict:
    """summary.json's "link_model" (the module's top) over the schedule's steps; C is
    `compute`, from `compute_of` (hardware.Compute: its source and inputs) when given,
    else measured."""
    mean = schedule.mean_traffic()
    tier = method_tier(num_nodes)
    dense = dense_bytes(gradient_bytes, num_towers, num_nodes)
    gradient = busiest_bytes(mean, tier, "gradient")
    num_bytes, messages = mean.busiest()
    compute_of = compute_of or hardware.Compute(compute, hardware.MEASURED, compute)
    out = {"steps": schedule.steps, "compute_seconds": compute, **compute_of.as_dict(),
           "where": "between nodes" if tier == "between" else "within one node",
           "gradient_bytes_per_step": gradient,
           "state_bytes_per_step": busiest_bytes(mean, tier, "state"),
           "dense_gradient_bytes_per_step": dense,
           "compression_ratio": _ratio(dense, gradient),
           "bytes_per_device": num_bytes, "messages_per_device": messages,
           "tiers": _tiers(mean, gradient_bytes, num_nodes),
           "syncs": _syncs(schedule, tier, dense),
           "links": {}}
    within = next((link for link in links if link.tier == "within"), None)
    for link in links:
        if link.tier == "within":
            continue  # charged with every between link
        exchange = exchange_of(link, within)
        out["links"][link.tag] = {
            "bandwidth_bytes_per_second": link.bytes_per_second,
            "latency_seconds": link.latency_seconds,
            "within": None if link.tier is None else within.name,
            "exchange_seconds": schedule.mean(exchange),
            "exchange_seconds_slowest_step": schedule.slowest(exchange),
            "step_seconds_no_overlap": (None if compute is None
                                        else compute + schedule.mean(exchange)),
            "step_seconds_overlap": (None if compute is None else
                                     schedule.mean_overlapped(exchange, compute))}
    return out


def gradient_bytes_of(trainer) -> int:
    """The float32 bytes of the trainable gradients (copy 0's variables)."""
    return sum(4 * v.shape.num_elements() for v in trainer.copies[0].trainable)


def report_of_run(trainer, links, schedule: Schedule, compute: hardware.Compute) -> dict:
    """`report` of a trained Trainer over `schedule` (its aggregation's traffic over its
    steps): the --link values `links`, the compute per step of --compute (measured: the
    run's median step less the exchange timed alone, link_model.compute_seconds; or
    modelled, hardware.py)."""
    aggregation = trainer.aggregation
    return report(schedule, [link_model.parse(text) for text in links], compute.seconds,
                  gradient_bytes=gradient_bytes_of(trainer), num_towers=aggregation.num_towers,
                  num_nodes=num_nodes(aggregation), compute_of=compute)


def num_nodes(aggregation) -> int:
    """The nodes of a run: its workers (each a node), else those of --nodes."""
    if aggregation.cluster is not None:
        return aggregation.cluster.num_workers
    return len(set(aggregation.traffic.node_of.values())) or 1
