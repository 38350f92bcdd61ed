"""`mgloop.launch --netns`: the workers of one machine on real, rate-limited links.

What a launch creates (as root, with iproute2's `ip` and `tc`), every name beginning with
the launch's own prefix `mgl<launcher pid>` (so its cleanup can only remove its own):

    namespace mgl<pid>-hub      a bridge `mgl<pid>br`, and one port `mgl<pid>h<i>` per
                                worker slot; no address: nothing in it sends
    namespace mgl<pid>-w<i>     worker i's network: `lo` and `mgl<pid>w<i>`, the other end
                                of the veth pair whose hub end is `mgl<pid>h<i>`, with
                                the address 10.A.B.(i+1)/24

Every veth is created inside its namespaces (`ip link add ... netns`), so nothing ever
appears in the launcher's own namespace. The /24 is a 10.A.B.0/24 (A in 200..254) that
overlaps no route and no address of the launcher's namespace; the workers' namespaces hold
no other address and no route but that /24's, so a worker can reach only the run's own
addresses. TF_CONFIG names the workers at 10.A.B.(i+1):PORT, and each worker runs as
`ip netns exec mgl<pid>-w<i> python -m mgloop.train ...` (the same process: `ip` execs it).

Shaping: each veth end's egress has `tc qdisc ... tbf rate B burst 1600 limit L`, the
worker's end (what it sends) and the hub's end (what it receives), so each worker has a
full-duplex link of B each way, as the link model's devices have (observe/link_model.py:
t = max(sent, received) / B), whatever the number of workers.

    burst 1600 B   one full frame (MTU 1500 + 14 B of Ethernet header = 1514 B) and the
                   margin tc's rounding needs (it turns 1514 into 1512 at 20 Mbit/s, and a
                   frame larger than the bucket is never sent): tbf cannot hold back less.
                   A message of M bytes that finds the link idle passes in (M - 1600) / B,
                   not M / B: 0.64 ms early at 20 Mbit/s, 0.13 ms at 100 Mbit/s (a burst of
                   many frames let a 2.6 KB message through at line rate).
    limit L        B x 1 s of bytes queued, at least 64 KiB: TCP's bursts wait in the
                   queue instead of being dropped (a drop costs a retransmission, up to a
                   200 ms timeout, that the model knows nothing of), and a health check
                   queued behind one second of data is still answered well inside
                   --collective_timeout.

Measured, TCP between two namespaces (python sockets), the 2-core machine busy: 500 kB at
20 Mbit/s in 209 ms (19.1 Mbit/s of payload; TCP/IP headers are 4.6% of a frame), 50 MB at
100 Mbit/s at 85 Mbit/s and at 1 Gbit/s at only 389 Mbit/s (tbf's timer on a loaded CPU); a
2.6 kB message after an idle link in 0.66 ms (1.04 less one burst). Refused: a bandwidth
outside 1 Mbit/s .. 1 Gbit/s.

Latency: `tc ... netem delay` at the root of the worker's end, the tbf under it (not at the
hub's end: a message is delayed once), where the kernel has netem (that branch is untested
here); without it (`Specified qdisc kind is unknown`, as on these machines) the tbf alone,
and one line at the start says that the latency is modelled only.

Removed (`Network.remove`, which the launcher calls in a `finally`, whatever ended the job:
success, a failed or killed worker, a signal to the launcher, the last elastic round;
elastic rounds reuse the namespaces): first every process still inside one of the run's
namespaces (`ip netns pids`) is killed, then each namespace is deleted, which destroys its
veth ends, the bridge and their qdiscs. A failure part way through `Network.create` removes
what it had made before it raises. Only SIGKILL to the launcher itself leaves them; they are
then named by `ip netns list | grep mgl<pid>-` and removed with `ip netns del NAME`.

May import: the standard library only (cluster/'s rule: ground modules).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import ipaddress
import os
import re
import shutil
import signal
import subprocess
from typing import Callable

BURST_BYTES = 1600  # one 1514 B frame and tc's rounding: the module docstring
QUEUE_SECONDS = 1.0  # the tbf limit, in seconds of data at the rate
MIN_QUEUE_BYTES = 64 * 1024
MIN_BITS_PER_SECOND = 1e6
MAX_BITS_PER_SECOND = 1e9
MAX_WORKERS = 253  # one /24, .1 .. .253
# what the kernel must have, as /proc/config.gz names it (y or m)
KERNEL_NEEDS = {"CONFIG_NET_NS": "network namespaces", "CONFIG_VETH": "veth pairs",
                "CONFIG_BRIDGE": "bridges", "CONFIG_NET_SCH_TBF": "the tbf qdisc"}
_COMMAND_SECONDS = 30.0


class NetnsError(RuntimeError):
    """A namespace, link or qdisc that could not be made: one line naming the command."""


@dataclasses.dataclass(frozen=True)
class Shaping:
    """What each worker's link is shaped to: --link=between:BANDWIDTH,LATENCY."""

    bits_per_second: float
    latency_seconds: float


def kernel_config() -> dict[str, str] | None:
    """/proc/config.gz as {CONFIG_X: "y" | "m" | "n"}, or None where the kernel does not
    publish it."""
    try:
        with gzip.open("/proc/config.gz", "rt") as config:
            text = config.read()
    except OSError:
        return None
    found = {m.group(1): m.group(2) for m in re.finditer(r"^(CONFIG_\w+)=(\S+)", text, re.M)}
    found.update({m.group(1): "n" for m in re.finditer(r"^# (CONFIG_\w+) is not set", text,
                                                       re.M)})
    return found


def refusal(num_workers: int, shaping: Shaping, euid: int | None = None,
            kernel: dict[str, str] | None = None) -> str | None:
    """The one line that refuses --netns on this machine or with these settings, or None.
    Reads only (nothing is created). `euid`, `kernel` (tests): instead of os.geteuid() and
    kernel_config() (None: the kernel does not say)."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        return ("--netns needs root (it creates network namespaces and qdiscs); run the "
                "launcher as root, or drop --netns")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (f"--netns needs iproute2's {' and '.join(missing)} command(s), not found on "
                "PATH; install iproute2, or drop --netns")
    kernel = kernel_config() if kernel is None else kernel
    if not os.path.exists("/proc/self/ns/net"):
        return "--netns needs network namespaces, which this kernel lacks; drop --netns"
    if kernel is not None:
        absent = [what for option, what in KERNEL_NEEDS.items()
                  if kernel.get(option, "n") not in ("y", "m")]
        if absent:
            return (f"--netns needs {', '.join(absent)}, which this kernel lacks "
                    f"(/proc/config.gz); drop --netns")
    if not 1 <= num_workers <= MAX_WORKERS:
        return (f"--netns puts the workers on one /24: --num_workers={num_workers} must be "
                f"1..{MAX_WORKERS}")
    rate = shaping.bits_per_second
    if not MIN_BITS_PER_SECOND <= rate <= MAX_BITS_PER_SECOND:
        return (f"--netns shapes the link to --link=between:'s bandwidth, {rate / 1e6:g} "
                "Mbit/s here: it must be 1mbit .. 1gbit (below, a frame takes longer than "
                "the health checks allow; above, tbf on a veth cannot hold the rate), e.g. "
                "--link=between:100mbit,50us")
    return None


def run(command: list[str], what: str) -> str:
    """Runs one `ip`/`tc` command; its stdout, or NetnsError naming it and what it said."""
    try:
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=_COMMAND_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise NetnsError(f"--netns: {what} failed: `{' '.join(command)}`: {error}") from None
    if done.returncode != 0:
        said = " ".join((done.stderr or done.stdout).split()) or f"exit code {done.returncode}"
        raise NetnsError(f"--netns: {what} failed: `{' '.join(command)}`: {said}")
    return done.stdout


def taken_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 prefix and address the launcher's namespace names in its routes (every
    table; the default route's 0.0.0.0/0 is not written so) and its addresses."""
    text = (run(["ip", "-4", "-o", "route", "show", "table", "all"], "reading the routes")
            + run(["ip", "-4", "-o", "addr", "show"], "reading the addresses"))
    return [ipaddress.ip_network(found, strict=False)
            for found in re.findall(r"\b\d{1,3}(?:\.\d{1,3}){3}(?:/\d{1,2})?\b", text)]


def choose_subnet(taken: list[ipaddress.IPv4Network], seed: int) -> ipaddress.IPv4Network:
    """A 10.A.B.0/24, A in 200..254, overlapping none of `taken`; the search starts at a
    place `seed` (the launcher's pid) decides, so that launches side by side differ."""
    count = 55 * 256
    for step in range(count):
        index = (seed + step) % count
        subnet = ipaddress.ip_network(f"10.{200 + index // 256}.{index % 256}.0/24")
        if not any(subnet.overlaps(network) for network in taken):
            return subnet
    raise NetnsError("--netns: every 10.200.0.0/24 .. 10.254.255.0/24 overlaps a route or "
                     "address of this machine; no private subnet is left for the workers")


def tbf(bits_per_second: float) -> list[str]:
    """The tbf arguments of one link end (module docstring)."""
    limit = max(int(bits_per_second / 8 * QUEUE_SECONDS), MIN_QUEUE_BYTES)
    return ["tbf", "rate", f"{int(bits_per_second)}bit", "burst", str(BURST_BYTES),
            "limit", str(limit)]


class Network:
    """The namespaces, links and qdiscs of one launch (module docstring). Made by `create`,
    ended by `remove` (idempotent; never raises)."""

    def __init__(self, prefix: str, subnet: ipaddress.IPv4Network, say: Callable[[str], None]):
        self.prefix, self.subnet, self.say = prefix, subnet, say
        self.hub = f"{prefix}-hub"
        self.namespaces: list[str] = []  # those created, in order (removed in reverse)
        self.latency_added = False

    @classmethod
    def create(cls, num_workers: int, shaping: Shaping, say: Callable[[str], None],
               prefix: str | None = None) -> "Network":
        """Makes the hub, one namespace per worker slot and their shaped links; on any
        failure removes what it made and raises NetnsError (one line)."""
        prefix = prefix or f"mgl{os.getpid()}"
        network = cls(prefix, choose_subnet(taken_networks(), os.getpid()), say)
        try:
            network._build(num_workers, shaping)
        except BaseException:
            network.remove(quiet=True)
            raise
        rate = f"{shaping.bits_per_second / 1e6:g} Mbit/s"
        say(f"netns: {num_workers} worker namespace(s) {prefix}-w0..w{num_workers - 1} on "
            f"{network.subnet} (a bridge in {network.hub}), each worker's link shaped by tbf "
            f"to {rate} each way (burst {BURST_BYTES} B, queue "
            f"{tbf(shaping.bits_per_second)[-1]} B)")
        if shaping.latency_seconds > 0 and not network.latency_added:
            say(f"netns: this kernel has no netem (`tc qdisc ... netem`: Specified qdisc kind "
                f"is unknown): the links add no latency; the {shaping.latency_seconds * 1e6:g} "
                "us of --link=between: is modelled only")
        elif network.latency_added:
            say(f"netns: netem delays what each worker sends by "
                f"{shaping.latency_seconds * 1e6:g} us")
        return network

    def _build(self, num_workers: int, shaping: Shaping) -> None:
        bridge = f"{self.prefix}br"
        self._add_namespace(self.hub)
        run(["ip", "-n", self.hub, "link", "add", bridge, "type", "bridge"], "adding the bridge")
        run(["ip", "-n", self.hub, "link", "set", bridge, "up"], "starting the bridge")
        netem = shaping.latency_seconds > 0
        for index in range(num_workers):
            name, port = self.namespace(index), f"{self.prefix}h{index}"
            device = f"{self.prefix}w{index}"
            self._add_namespace(name)
            run(["ip", "link", "add", device, "netns", name, "type", "veth", "peer", "name",
                 port, "netns", self.hub], f"adding worker {index}'s veth pair")
            run(["ip", "-n", name, "link", "set", "lo", "up"], f"starting worker {index}'s lo")
            address = f"{self.address(index)}/{self.subnet.prefixlen}"
            run(["ip", "-n", name, "addr", "add", address, "dev", device],
                f"giving worker {index} its address")
            run(["ip", "-n", name, "link", "set", device, "up"], f"starting {device}")
            run(["ip", "-n", self.hub, "link", "set", port, "master", bridge],
                f"joining {port} to the bridge")
            run(["ip", "-n", self.hub, "link", "set", port, "up"], f"starting {port}")
            netem = self._shape(name, device, shaping, netem)  # one delay per crossing
            self._shape(self.hub, port, shaping, False)
        self.latency_added = netem

    def _shape(self, where: str, device: str, shaping: Shaping, netem: bool) -> bool:
        """tbf on `device`'s egress, under a netem delay when `netem` and the kernel has it;
        returns whether netem was added."""
        if netem:
            try:
                run(["tc", "-n", where, "qdisc", "add", "dev", device, "root", "handle", "1:",
                     "netem", "delay", f"{shaping.latency_seconds * 1e6:.3f}us", "limit",
                     "100000"], f"adding a netem delay on {device}")
            except NetnsError as error:
                if "unknown" not in str(error).lower():
                    raise
            else:
                run(["tc", "-n", where, "qdisc", "add", "dev", device, "parent", "1:1",
                     "handle", "10:", *tbf(shaping.bits_per_second)], f"shaping {device}")
                return True
        run(["tc", "-n", where, "qdisc", "add", "dev", device, "root",
             *tbf(shaping.bits_per_second)], f"shaping {device}")
        return False

    def _add_namespace(self, name: str) -> None:
        if os.path.exists(os.path.join("/run/netns", name)):
            raise NetnsError(
                f"--netns: the namespace {name} exists already (left by an earlier launcher "
                f"of pid {self.prefix[3:]} that was killed by SIGKILL?); it is not this "
                f"launch's to remove: check `ip netns pids {name}` and `ip netns del {name}`")
        run(["ip", "netns", "add", name], f"adding the namespace {name}")
        self.namespaces.append(name)

    def namespace(self, index: int) -> str:
        return f"{self.prefix}-w{index}"

    def address(self, index: int) -> str:
        return str(self.subnet.network_address + index + 1)

    def exec_prefix(self, index: int) -> list[str]:
        """What runs a command in worker `index`'s namespace (the same process: `ip` execs)."""
        return ["ip", "netns", "exec", self.namespace(index)]

    def dropped(self) -> int:
        """Packets the run's tbf queues dropped so far (their queue was full)."""
        shown = "".join(run(["tc", "-s", "-n", name, "qdisc", "show"], "reading the qdiscs")
                        for name in self.namespaces)
        return sum(int(n) for n in re.findall(r"dropped (\d+)", shown))

    def remove(self, quiet: bool = False) -> None:
        """Kills every process left in the run's namespaces and deletes them (their links
        and qdiscs go with them); says one line of what was removed, or of what could not
        be and how to remove it by hand."""
        if not self.namespaces:
            return
        try:
            dropped = "?" if quiet else self.dropped()
        except NetnsError:
            dropped = "?"
        left = []
        for name in reversed(self.namespaces):
            try:
                pids = run(["ip", "netns", "pids", name], f"listing {name}'s processes")
                for pid in map(int, pids.split()):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                run(["ip", "netns", "del", name], f"deleting the namespace {name}")
            except NetnsError as error:
                if os.path.exists(os.path.join("/run/netns", name)):
                    left.append((name, str(error)))
        removed = [n for n in self.namespaces if n not in dict(left)]
        self.namespaces = [name for name, _ in left]
        if left:
            self.say(f"netns: could not remove {', '.join(n for n, _ in left)} ({left[0][1]}); "
                     f"remove by hand: {'; '.join(f'ip netns del {n}' for n, _ in left)}")
        elif not quiet:
            self.say(f"netns: removed {', '.join(removed)} and their links "
                     f"({dropped} packet(s) dropped by the shaped queues)")
