"""The overlap of the gradient exchange with the backward pass in one profiler trace.

See experiments/overlap.py (the figures, how the ops are classified). Times in
the trace are picoseconds; the results are milliseconds and fractions.
"""

from __future__ import annotations

import re

_BACKWARD = re.compile(r"(gradient_tape|gradients)(_\d+)?")


def merged(intervals) -> list[tuple[int, int]]:
    """The union of [start, end) intervals as disjoint sorted intervals."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals) -> int:
    return sum(end - start for start, end in intervals)


def intersection(a, b) -> int:
    """Length of the intersection of two disjoint sorted interval lists."""
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, high - low)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def is_backward(name: str) -> bool:
    return any(_BACKWARD.fullmatch(segment) for segment in name.split("/"))


def overlap_of(space) -> dict:
    """The figures of one trace (see the top of this module)."""
    from mgloop.observe import breakdown
    exchange, backward = [], []
    for name, start, end in breakdown.op_intervals(space):
        phase = breakdown.phase_of(name)
        if phase == "aggregation":
            exchange.append((start, end))
        elif phase == "compute" and is_backward(name):
            backward.append((start, end))
    if not exchange or not backward:
        raise ValueError(f"the trace has {len(exchange)} exchange and {len(backward)} backward "
                         "ops: nothing to compare")
    exchange, backward = merged(exchange), merged(backward)
    busy = length(exchange)
    before_end = intersection(exchange, [(exchange[0][0], backward[-1][1])])
    return {"exchange_ms": busy * 1e-9, "backward_ms": length(backward) * 1e-9,
            "overlap": intersection(exchange, backward) / busy, "early": before_end / busy,
            "starts": (exchange[0][0] - backward[0][0]) / (backward[-1][1] - backward[0][0])}
