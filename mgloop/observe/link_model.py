"""What a step's exchange would take on a real network: the alpha-beta link model.

On one machine the towers share memory, so the exchange's wall-clock time says
nothing about a network. `--link=BANDWIDTH,LATENCY` (repeatable) asks for a model
of it instead, computed after training from the step's exact traffic counts
(aggregation/base.py `Traffic`: bytes and messages each device sends and receives
per step, counted while the step is traced).

The model. Every device has its own full-duplex link of bandwidth B (bytes/s) and
latency a (seconds per message), as if each tower were a machine on a switch. A
device's sends share its outgoing direction and its receives its incoming one, the
two directions run at once, and each message pays the latency once:

    t_d = a * max(m_sent_d, m_recv_d) + max(b_sent_d, b_recv_d) / B
    exchange time = max_d t_d

For the algorithms of mgloop, with S the bytes of gradients and T towers, this is:

    ring all-reduce       2(T-1) a + 2(T-1)/T * S/B   (NCCL's performance notes; per
                          tensor or bucket, each its own ring)
    ring all-gather       (T-1) a + (T-1)/T * S/B     (S the gathered bytes, S/T each)
    reduce_broadcast      (T-1) a + (T-1) S/B          (tower 0 receives T-1 copies and
                          sends T-1; its two directions overlap)
    ps_cpu                (T-1) (k a + S/B)            (host = tower 0's CPU: it sends the
                          k variables to T-1 towers and receives their gradients)

per tensor or bucket for reduce_broadcast and the ring (k of them: k times the latency).

Two tiers. `--link=within:100gbit,2us --link=between:10gbit,50us` models the links
inside a node and between nodes apart (the traffic counts each send as within or
between nodes, aggregation/traffic.py; aggregation/placement/between_nodes.py): one figure per
`between` link, each with the one `within` link,

    exchange time = max_d t_d(within traffic, within link)
                    + max_d t_d(between traffic, between link)

the intra-node stage and the inter-node stage one after the other: the node-level
exchange (placement/between_nodes.py) sums inside the node, then exchanges between nodes, then
broadcasts inside the node, so no method's stages overlap there. An untiered
`--link=B,L` still charges every send alike.

Limits (what the model leaves out; docs/methods/link-model.md):
  * every message pays the full latency, and messages of one device are
    sequential: collectives that a real runtime would pipeline or overlap
    (buckets, shards, tensors) are charged one after the other;
  * no congestion: a switch with full bisection bandwidth, each device limited by
    its own link alone;
  * a device's two directions overlap, even where its sends wait for its receives
    (reduce_broadcast's root broadcasts a tensor once it has summed it): for one
    tensor the root's true time is up to twice the model's, for many tensors the
    broadcast of one overlaps the reduce of the next;
  * one link for every pair of devices: inside a worker as between workers. Across
    workers each process counts its own devices' traffic (the chief's is reported),
    the collective between workers being 2(W-1) messages of 2(W-1)/W of its buffer
    on the worker's copy 0 device (cross_worker.py), on top of the local stage's.

The compute time beside it is measured by default: the median step time of the run (every step
but the run's first, which traces the loop: runs/controller.py), less the exchange timed alone in this process
(exchange_timing.py: the in-memory exchange, its additions included), never less
than 0; `--compute` models it instead for an accelerator profile or gives it
(hardware.py, `--node_speeds` for slow nodes). The modelled step time is compute + exchange without overlap, and
max(compute, exchange) with perfect overlap of the exchange with the compute:
the two bounds between which a real run falls. The run's report, averaged over its
steps (a method that syncs every H steps moves its bytes on those steps only), is
link_report.py's; what a run writes of it (TensorBoard scalars, HParams metrics) is
link_scalars.py's.
"""

from __future__ import annotations

import dataclasses
import re

from mgloop.aggregation.traffic import TIERS
from mgloop.errors import ConfigError

# bits per second per unit (decimal, as network links are sold); also written gbit/s, gbps
BANDWIDTH_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
LATENCY_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_QUANTITY = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]+(?:/s)?)\s*")
_EXAMPLE = "e.g. --link=10gbit,10us"


@dataclasses.dataclass(frozen=True)
class Link:
    """One modelled link: `name` (its flag value, e.g. "10gbit,10us"), bandwidth, latency."""

    name: str
    bytes_per_second: float
    latency_seconds: float
    tier: str | None = None  # "within" or "between" a node; None: every send

    @property
    def tag(self) -> str:
        """The name in TensorBoard tags and tables: "10gbit_10us", "between_10gbit_50us"."""
        tag = re.sub(r"[^a-z0-9.]+", "_", self.name)
        return f"{self.tier}_{tag}" if self.tier else tag


def _quantity(text: str, units: dict[str, float], what: str, link: str) -> float:
    match = _QUANTITY.fullmatch(text.lower())
    unit = match and re.sub(r"bps$", "bit", re.sub(r"/s$", "", match.group(2)))
    if not match or unit not in units:
        raise ConfigError(f"--link={link}: {what} {text.strip()!r} is not a number with a unit "
                          f"of {', '.join(units)} ({_EXAMPLE})")
    return float(match.group(1)) * units[unit]


def parse(text: str) -> Link:
    """`[within:|between:]BANDWIDTH,LATENCY` (e.g. "10gbit,10us", "between:10gbit,50us") as
    a Link; ConfigError (one line) otherwise. Bandwidth in bit/kbit/mbit/gbit/tbit per
    second (> 0), latency in ns/us/ms/s (>= 0)."""
    tier, _, rest = text.partition(":")
    if rest and tier.strip().lower() in TIERS:
        return dataclasses.replace(parse(rest), tier=tier.strip().lower())
    if rest and tier.strip().isalpha():  # a word before ':' that names no tier
        raise ConfigError(f"--link={text}: the tier {tier.strip()!r} is not one of: "
                          f"{', '.join(f'{t}:' for t in TIERS)} (e.g. --link=within:"
                          "100gbit,2us --link=between:10gbit,50us), or leave it out")
    parts = text.split(",")
    if len(parts) != 2:
        raise ConfigError(f"--link={text}: give BANDWIDTH,LATENCY ({_EXAMPLE})")
    bits = _quantity(parts[0], BANDWIDTH_UNITS, "bandwidth", text)
    latency = _quantity(parts[1], LATENCY_UNITS, "latency", text)
    if bits <= 0:
        raise ConfigError(f"--link={text}: the bandwidth must be > 0")
    name = ",".join(p.replace(" ", "").lower() for p in parts)
    return Link(name, bits / 8.0, latency)


def check_links(texts: tuple[str, ...]) -> None:
    """Every --link parses, no link is given twice, and tiered links come as one within
    link and at least one between link."""
    links = [parse(text) for text in texts]
    tags = [link.tag for link in links]
    for link in links:
        if tags.count(link.tag) > 1:
            raise ConfigError(f"--link={link.name} is given twice; give each link once")
    within = [link for link in links if link.tier == "within"]
    between = [link for link in links if link.tier == "between"]
    if len(within) > 1:
        raise ConfigError(f"--link=within: is given {len(within)} times; give one link inside "
                          "a node (several --link=between: are allowed)")
    if between and not within:
        raise ConfigError("--link=between:... needs the link inside a node too: add "
                          "--link=within:BANDWIDTH,LATENCY (e.g. within:100gbit,2us)")
    if within and not between:
        raise ConfigError(f"--link=within:{within[0].name} needs a link between nodes: add "
                          "--link=between:BANDWIDTH,LATENCY (e.g. between:10gbit,50us)")


def traffic_of(bytes_per_device: dict, messages_per_device: dict):
    """A Traffic from `Traffic.as_dict()` and `messages_as_dict()` (e.g. read from JSON)."""
    from mgloop.aggregation.base import Traffic
    traffic = Traffic()
    for device, counts in bytes_per_device.items():
        messages = messages_per_device.get(device, {})
        traffic.add(device, sent=counts["sent"], received=counts["received"],
                    messages_sent=messages.get("sent", 0),
                    messages_received=messages.get("received", 0))
    return traffic


def device_seconds(traffic, link: Link) -> dict[str, float]:
    """t_d (top of the module) of every device that sends or receives in the step."""
    out = {}
    for device in traffic.devices():
        messages = max(traffic.messages_sent.get(device, 0),
                       traffic.messages_received.get(device, 0))
        num_bytes = max(traffic.sent.get(device, 0), traffic.received.get(device, 0))
        out[device] = link.latency_seconds * messages + num_bytes / link.bytes_per_second
    return out


def exchange_seconds(traffic, link: Link) -> float:
    """The modelled exchange time of one step: max over devices of t_d (0: no traffic)."""
    return max(device_seconds(traffic, link).values(), default=0.0)


def bytes_per_device(traffic) -> int:
    """The busiest device's bytes per step, max(sent, received): what the bandwidth term
    of the model charges (for the ring every device's, 2(T-1)/T S)."""
    return traffic.busiest()[0]


def compute_seconds(median_step_time: float | None,
                    exchange_alone: float | None) -> float | None:
    """The measured step time less the in-memory exchange timed alone, >= 0 (top of the
    module); None without a measured step time. A mode without an exchange to time apart
    (single loss) keeps its in-memory transfers in its compute."""
    if median_step_time is None:
        return None
    return max(median_step_time - (exchange_alone or 0.0), 0.0)


def dense_ring_bytes(gradient_bytes: int, num_towers: int) -> int:
    """Bytes per device of a float32 ring all-reduce of the gradients: 2(T-1)/T of them."""
    return 2 * (num_towers - 1) * gradient_bytes // num_towers


def tiered_exchange_seconds(traffic, within: Link, between: Link) -> float:
    """The two-tier model (top of the module): the within stage, then the between stage."""
    return (exchange_seconds(traffic.tier("within"), within)
            + exchange_seconds(traffic.tier("between"), between))
