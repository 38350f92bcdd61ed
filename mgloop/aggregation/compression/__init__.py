"""Lossy compressed exchanges with error feedback (docs/methods/compression.md).

`base.py`: the shared machinery (the `memory` option, per-tower state, the two
transports, per-step seeds, exact byte counts); `transport.py`: the ring
all-gather; one module per method (topk.py, ...), each registered by
mgloop/aggregation/__init__.py's import list.

May import what aggregation/ may, and aggregation's base modules.
"""
