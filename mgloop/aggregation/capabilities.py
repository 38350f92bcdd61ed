"""`Capabilities`: what one aggregation method can do, declared once as one record.

A method (aggregation/base.py's `Aggregation`) declares its record as a class attribute,

    capabilities = Capabilities(layout=REPLICATED, exact=False, summable=False, ...)

or derives it from its parent's, `capabilities = Parent.capabilities.but(identity="d=0")`;
a wrapper (placement/wrapper.py) sets its instance's from the method it wraps. Validation,
the step and the contract test read `method.capabilities.FIELD`, never a method's name.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What one method can do (each field's docstring below); frozen: derive with `but`."""

    layout: str
    """The layout it supports: "shared" (base.py's SHARED), one variable copy; "replicated"
    (REPLICATED), one per tower."""

    exchanges: bool = True
    """False: no gradient exchange to compress or pack."""

    single_loss: bool = False
    """True: one loss over all towers (colocate.py)."""

    exact: bool = True
    """True: `reduce` returns (1/T) sum_t g[t] to float tolerance (equals one device).
    False: lossy, within `error_bound`, or, without an exchange, not a mean at all."""

    summable: bool = True
    """May be packed into buckets and ride on an all-reduce: `reduce` is element-wise linear
    in the towers' values and keeps no per-variable state. Otherwise buckets are refused
    (validation.py) and never formed, and `unsummable_reason` says why."""

    unsummable_reason: str = ("its reduce is not an element-wise sum of the towers' values "
                              "(it needs each tensor whole, e.g. to gather)")
    """Why it is not `summable` (the refusal's words)."""

    across_workers: bool = True
    """Works across worker processes, as the local stage of cross_worker.py: `reduce(...,
    average=False)[0]` is this worker's sum of its towers' contributions on copy 0's device."""

    compressed_transport: bool = True
    """Honours --transport_dtype (sends through `send`); False: its kernel sums in the dtype
    it is given, so a compressed transport could not keep the sums in float32."""

    device_kinds: tuple[str, ...] = ("cpu", "gpu")
    """The tower kinds it runs on."""

    sums_at_home: bool = False
    """True: `reduce` sums and scales each variable's tower values on `home_of(variable)`."""

    averages_non_trainable: bool = True
    """False: copy t keeps tower t's non-trainable state (independent.py); otherwise the
    towers' float state is averaged by mgloop's exact path (non_trainable.py), never
    `reduce`."""

    copies_differ: bool = False
    """True: the variable copies differ between the method's synchronisations (local SGD,
    DiLoCo): a checkpoint holds every copy with its optimizer, and a restore keeps them."""

    identity: str | None = None
    """Options (a spec's `key=value,...` part) under which a method whose updates are by
    design not the synchronous one (stale reads, local steps) trains exactly as synchronous
    training, e.g. "period=1": the contract test checks that against one device. None: the
    method is `exact`, lossy within `error_bound`, or has no exchange."""

    buckets_payloads: bool = False
    """True: the per-tensor payloads it gathers are fused into buckets of --pack_bytes for
    the transport (compression/base.py's `gather_in_buckets`), though it is not summable."""

    runs_between_processes: bool = False
    """True: every value it moves between its towers goes through the transports that reach
    other processes with `peers` (ring.py, transport.py, gather_at_root.py, the parameter
    servers' sums; peers.py), so it runs between workers at the nodes. False (e.g. a method
    that only `send`s between its own towers): refused at the nodes across workers."""

    copies_per_device: bool = False
    """True: with K towers on one device (--towers_per_device, DeviceSet.copy_devices) one
    copy per device, and `reduce` returns one output per device, sent once
    (gather_at_root.py); False: one per tower, kept per device by device_groups.py."""

    needs_optimizer: str | None = None
    """The --optimizer it needs (des_loc: adam)."""

    resize_refusal: str | None = None
    """Why its per-node state cannot resume with another worker count (None: `rejoined`'s
    rule)."""

    def but(self, **changes) -> Capabilities:
        """This record with `changes` (field=value, ...): `dataclasses.replace`."""
        return dataclasses.replace(self, **changes)


# The names a method declared one by one before this record: `register` refuses a class
# that still declares one of them (an old plugin, silently ignored otherwise).
FIELDS = tuple(field.name for field in dataclasses.fields(Capabilities))
