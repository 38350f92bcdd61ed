"""Lossy compressed exchanges with error feedback (docs/methods/compression.md).

`base.py`: the shared machinery (the `memory` option, per-tower state, the choice
between the two transports, per-step seeds, exact byte counts); `sites.py`: where one
compression happens (`Site`) and what it made (`Encoded`); `transport.py`: how
payloads travel (the ring all-gather, buckets) and what every tower forms from them
(the ring's sums, the gathered sums); `sizes_first.py`: payloads whose length the data
decides (threshold), counts gathered first; one module per method (topk.py, ...), each
registered by mgloop/aggregation/__init__.py's import list.

May import what aggregation/ may, and aggregation's base modules.
"""
