"""The base of every compressed method: compress on each tower, move, decompress, sum.

Per step, variable v (n elements, flattened) and tower t (on tower t's device):

    x_t = prepare(g_t)                 default: g_t + e_t with memory=residual, else g_t
    a_t = agree(x_0..x_{T-1})[t]       default None; e.g. a scale every tower shares
    p_t = compress(x_t)                the payload: a tuple of tensors, as they travel
    c_t = decompress(p_t)              what the other towers will reconstruct, dense
    e_t <- x_t - c_t                   memory=residual (error feedback), else no state

then the payloads travel (transport.py) and every tower forms

    out[v] = (1/T) sum_t c_t           (the sum with average=False)

`memory=residual` is error feedback (Seide et al. 2014; Stich et al. 2018): what a
tower did not send this step is added to its next gradient, so the identity
c_t + e_t(new) = g_t + e_t(old) holds exactly for the sparsifiers (c_t and e_t take
complementary entries of x_t). The float parts of p_t are rounded to
`--transport_dtype` on tower t before c_t is formed, so c_t is exactly what the
receivers decode and the residual keeps what the cast lost (on the summable
transport the ring also rounds its partial sums at every hop, as `ring` does).

State (contract state: checkpointed, restored, broadcast, changed by the step alone),
per tower t on tower t's device: the residuals e_t (memory=residual only), the
method's own `extra_state` per variable, and `steps`, an int64 count of exchanges.
Seeds: `site.shared_seed` is the stateless seed pair
fold_in(fold_in([S, steps], v), 0) with S the global TensorFlow seed when the method
was made (`--seed`: experiment.seed_everything runs first), identical on every tower
in a step, different per step and variable, and restored with `steps` on resume;
`site.tower_seed` folds in the tower's global index as well (an independent stream
per tower, across workers too).

Bytes: every part of every payload goes through `send`: float values at
`--transport_dtype`, the rest as `pack` makes it (aggregation/kernels/bitpacking.py): signs,
ternary values and levels as bit fields in uint8 tensors, indices at the narrowest
integer type that holds them. Those are the tensors sent, so the traffic counts are
exact. A SUMMABLE method whose payload packs (signSGD's votes, QSGD's levels) gathers
the packed payloads instead of summing them in the ring when that moves fewer bytes,
T ceil(n w / 8) < 2 n s (w bits packed against s bytes of the ring's integers; one
process's T towers, or the N nodes): every tower unpacks the T payloads and adds each
part in tower order (integers exactly), then decompresses the sum once. Between
workers at the nodes (the default for a compressor; between_nodes.py, peers.py) the method
has one tower per worker and its gathers and sums are collectives between the
processes: the packed payloads travel. At --method_at=towers across workers
(cross_worker.py) the local stage returns this worker's sum of decompressed
contributions, sum_{t in w} c_t, and the workers add those DENSE sums in the float
collective.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import tensorflow as tf

from mgloop.aggregation.base import REPLICATED, Aggregation, Options, option
from mgloop.aggregation.capabilities import Capabilities
from mgloop.aggregation.compression import transport
from mgloop.aggregation.compression.sites import Encoded, Site
from mgloop.aggregation.compression.transport import GATHER, SUMMABLE, gather_in_buckets
from mgloop.aggregation.kernels import bitpacking

MEMORIES = ("none", "residual")
_TOWER_DOMAIN = 1 << 20  # folded in with the tower index: apart from variable indices


def memory_option(default: str, paper: str):
    """The `memory` field every compressed method's options carry, with its paper default."""
    return option(default, f"error feedback: residual keeps what was not sent and adds it "
                           f"to the next gradient; none drops it (default from {paper})",
                  choices=MEMORIES)


@dataclasses.dataclass(frozen=True)
class CompressionOptions(Options):
    memory: str = memory_option("residual", "the method's paper")


class Compressed(Aggregation):
    """Subclass, set `name`, `options_type` (with a `memory` field: memory_option),
    `transport` (SUMMABLE or GATHER; or its own `exchange_encoded`: threshold's sizes first,
    sizes_first.py), implement `compress`, `decompress`, `error_bound`;
    optionally `prepare`/`update_state` (e.g. DGC's momentum) and `extra_state`; a method
    that packs its payload beyond the default (`pack`) unpacks it in `unpack_rows`."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "unpack" in vars(cls):  # the receivers call unpack_rows: it would go unused
            raise TypeError(f"{cls.__name__} defines unpack: define unpack_rows (the R wires "
                            "a tower received at once; unpack is its view of one wire)")

    capabilities = Capabilities(
        layout=REPLICATED, exact=False,
        # Buckets are never packed: the residuals and selections are per variable.
        summable=False,
        unsummable_reason=("it compresses each gradient by itself (per-variable residuals "
                           "and selections), so gradients cannot be packed into buckets"),
        across_workers=True,  # at towers the workers add dense local sums (module docstring)
        buckets_payloads=True,  # gathered wires travel in buckets of `bucket_bytes`
        runs_between_processes=True)  # its transports reach other processes (peers.py)
    options_type: ClassVar[type[Options]] = CompressionOptions
    transport: ClassVar[str] = GATHER
    # GATHER payloads that are (values, int32 indices), each index once: every tower adds
    # them into one accumulator by scatter-add in tower order (n floats of memory, not T n).
    sparse_payload: ClassVar[bool] = False
    own_state_keys: ClassVar[tuple[str, ...]] = ()  # extra_state of a node's own (rejoined)

    # ---- bit-packing (on the wire only; compress/decompress see the payload itself) ----
    def pack(self, payload: tuple, site: Site) -> tuple:
        """The tensors that travel for `payload`. Default: a sparse payload's indices at
        the narrowest integer type (bitpacking.index_dtype), else the payload as it is."""
        if self.sparse_payload:
            values, index = payload
            return values, bitpacking.pack_indices(index, site.size)
        return payload

    def unpack_rows(self, wires: tuple, site: Site) -> tuple:
        """The payloads `pack` made R wires from, exactly, as one batch (a gather's
        receiver traces linear in the payload's fields, not in R): each part of `wires`
        stacks that part of the R wires ([R, ...]), each part returned the R payloads'.
        Default: a sparse payload's indices as int32, else the parts as they are."""
        if self.sparse_payload:
            values, index = wires
            return values, tf.cast(index, tf.int32)
        return wires

    def unpack(self, wire: tuple, site: Site) -> tuple:
        """The payload `pack` made `wire` from, exactly: `unpack_rows` of it alone."""
        rows = self.unpack_rows(tuple(tf.expand_dims(part, 0) for part in wire), site)
        return tuple(part[0] for part in rows)

    def decompress_rows(self, payloads: tuple, site: Site) -> tf.Tensor:
        """[R, n]: `decompress` of R payloads at once (parts [R, ...], as `unpack_rows`
        gives them), row r the bits of decompressing payload r. Default: one `decompress`
        per row; an elementwise one broadcasts over the rows instead."""
        return tf.stack([self.decompress(tuple(part[r] for part in payloads), site)
                         for r in range(payloads[0].shape[0])])

    def __init__(self, devices, options=None, transport_dtype="float32", bucket_bytes: int = 0,
                 **construction):
        super().__init__(devices, options, transport_dtype, **construction)
        self.bucket_bytes = bucket_bytes  # --pack_bytes: of gathered wires; 0: a send per part
        self.seed = tf.compat.v1.get_seed(None)[0] or 0  # --seed (set before make)
        self.residuals, self.extra, self.steps = [], [], []

    # ---- what a method implements ----
    def compress(self, x: tf.Tensor, site: Site) -> tuple:
        """Payload of the flat x (on site.device): a tuple of tensors as they travel."""
        raise NotImplementedError

    def decompress(self, payload: tuple, site: Site) -> tf.Tensor:
        """The flat dense tensor (site.size elements) a payload stands for. SUMMABLE: must be
        linear in the payload (it is applied to the sum of the towers' payloads)."""
        raise NotImplementedError

    def extra_state(self, variable: tf.Variable, index: int, tower: int) -> dict:
        """{name: initial value} of per-tower state for one variable besides the residual
        (e.g. DGC's momentum, PowerSGD's Q). Default: none."""
        return {}

    def prepare(self, g: tf.Tensor, site: Site) -> tf.Tensor:
        """x_t from the flat gradient: g + residual with memory=residual, else g."""
        residual = self.residual(site)
        return g if residual is None else g + tf.reshape(residual, [-1])

    def update_state(self, x: tf.Tensor, sent: tf.Tensor, site: Site) -> list:
        """After compressing: e <- x - c with memory=residual. Returns the assign ops."""
        residual = self.residual(site)
        if residual is None:
            return []
        return [residual.assign(tf.reshape(x - sent, residual.shape))]

    def agree(self, xs: list, sites: list) -> list:
        """Per tower, a value every tower agrees on before any compresses, given every
        tower's x (may exchange through `send`, e.g. a shared scale); stored as
        `site.agreed`. Default: None for every tower, nothing exchanged."""
        return [None] * len(xs)

    def gathers_packed(self, encoded: "Encoded") -> bool:
        """SUMMABLE: whether a variable's packed wires are gathered (and summed after
        unpacking) instead of its payloads summed on the ring. Default: when that moves
        fewer bytes (transport.gather_is_cheaper); signSGD's 1-bit votes always are."""
        return transport.gather_is_cheaper(self, encoded.payloads[0], encoded.wires[0])

    def exchange_started(self, average: bool) -> None:
        """Called once per traced exchange before any variable (e.g. to read `average`)."""
        return None  # (a body of only a docstring is one AutoGraph cannot convert)

    # ---- the machinery ----
    @property
    def uses_memory(self) -> bool:
        return self.options.memory == "residual"

    @property
    def all_towers(self) -> int:
        """T over every worker (`cluster`: cross_worker.py's local stage)."""
        return self.num_towers * (self.cluster.num_workers if self.cluster else 1)

    @property
    def first_tower(self) -> int:
        """The global index of this worker's tower 0 (worker-major order)."""
        return self.cluster.index * self.num_towers if self.cluster else self.tower_offset

    def residual(self, site: Site):
        return self.residuals[site.tower][site.index] if self.uses_memory else None

    def parameter_devices(self):
        return list(self.devices.towers)

    def build(self, variables):
        self.residuals, self.extra, self.steps = [], [], []
        for t, device in enumerate(self.devices.towers):
            with tf.device(device):
                self.steps.append(tf.Variable(0, dtype=tf.int64, trainable=False,
                                              name=f"{self.name}_steps_{t}"))
                self.residuals.append([
                    tf.Variable(tf.zeros(tuple(v.shape), v.dtype), trainable=False,
                                name=f"{self.name}_residual_{t}_{i}")
                    for i, v in enumerate(variables)] if self.uses_memory else [])
                self.extra.append([
                    {key: tf.Variable(value, trainable=False, name=f"{self.name}_{key}_{t}_{i}")
                     for key, value in self.extra_state(v, i, t).items()}
                    for i, v in enumerate(variables)])

    @property
    def state_variables(self):
        out = list(self.steps)
        for t in range(len(self.steps)):
            out += list(self.residuals[t])
            out += [self.extra[t][i][key] for i in range(len(self.extra[t]))
                    for key in sorted(self.extra[t][i])]
        return out

    def rejoined(self, copies) -> None:
        """A joining node's memory (residuals, own momenta) at 0; shared state stays node 0's."""
        for own in [*(r for rs in self.residuals for r in rs), *(
                state[key] for states in self.extra for state in states
                for key in self.own_state_keys)]:
            own.assign(tf.zeros_like(own))

    def site(self, tower: int, index: int, value: tf.Tensor) -> Site:
        """The seeds are computed on the tower's device, when first read."""
        def seeds():
            base = tf.stack([tf.constant(self.seed, tf.int64), self.steps[tower].read_value()])
            shared = tf.random.experimental.stateless_fold_in(base, index)
            return (tf.random.experimental.stateless_fold_in(shared, 0),
                    tf.random.experimental.stateless_fold_in(
                        shared, _TOWER_DOMAIN + self.first_tower + tower))
        return Site(tower, index, self.devices.towers[tower], value.shape, value.dtype,
                    seeds, self.extra[tower][index])

    def wire_round(self, payload: tuple) -> tuple:
        """The payload as the receivers will see it: floats through --transport_dtype."""
        wire = self.transport_dtype
        return tuple(tf.cast(tf.cast(p, wire), p.dtype) if p.dtype.is_floating
                     and p.dtype != wire else p for p in payload)

    def encode(self, tower_values, i: int) -> "Encoded":
        """Variable i on every tower: x_t, the agreed values, p_t, c_t, the state update,
        the packed wire w_t (module docstring)."""
        towers = list(self.devices.towers)
        out = Encoded([], [], [], [])
        xs = []
        for t, device in enumerate(towers):
            with tf.device(device):
                g = tower_values[t][i]
                out.sites.append(self.site(t, i, g))
                xs.append(self.prepare(tf.reshape(g, [-1]), out.sites[t]))
        for site, agreed in zip(out.sites, self.agree(xs, out.sites)):
            site.agreed = agreed
        for t, device in enumerate(towers):
            with tf.device(device):
                payload = self.wire_round(tuple(self.compress(xs[t], out.sites[t])))
                c = self.decompress(payload, out.sites[t])
                self.update_state(xs[t], c, out.sites[t])
                out.wires.append(tuple(self.pack(payload, out.sites[t])))
            out.payloads.append(payload)
            out.sent.append(c)
        return out

    def exchange_encoded(self, encoded: list) -> list[list[tf.Tensor]]:
        """totals[i][t]: the flat sum over every tower of variable i's c, on tower t, from
        the payloads `encoded` (per variable): by the method's transport (module docstring)."""
        gathered = gather_in_buckets(self, encoded, [
            i for i, e in enumerate(encoded) if self.transport == GATHER
            or self.gathers_packed(e)])
        out = []
        for i, e in enumerate(encoded):
            if self.transport == GATHER:
                out.append(transport.gathered_sums(self, gathered[i], e.sites))
            elif i in gathered:
                out.append(transport.gathered_payload_sums(self, gathered[i], e.sites))
            else:
                out.append(transport.summed(self, e.payloads, e.sites))
        return out

    def reduce(self, tower_values, variables, average=True):
        towers = list(self.devices.towers)
        self.exchange_started(average)
        encoded = [self.encode(tower_values, i) for i in range(len(variables))]
        per_var = []
        for e, totals in zip(encoded, self.exchange_encoded(encoded)):
            outs, scaled = [], {}  # towers of one device may share a total (transport.py)
            for device, total, site in zip(towers, totals, e.sites):
                if id(total) not in scaled:
                    with tf.device(device):
                        scaled[id(total)] = tf.reshape(self.scale(total, average), site.shape)
                outs.append(scaled[id(total)])
            per_var.append(outs)
        for t, device in enumerate(towers):
            with tf.device(device):
                self.steps[t].assign_add(1)
        return [list(per_copy) for per_copy in zip(*per_var)]

__all__ = ["Compressed", "CompressionOptions", "Site", "memory_option", "GATHER", "SUMMABLE",
           "MEMORIES"]
