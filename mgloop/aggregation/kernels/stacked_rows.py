"""Rows of a stacked tensor, stacked again without a copy.

With --towers_per_device=K a device's K towers' gradients of a variable come out of one
vectorized computation as one tensor [K, ...] (vectorized_towers.py), handed to the step
as its K rows. A method that needs every tower's gradient stacked along a leading axis
(gather_at_root.py) would `tf.stack` them back: a copy of every tower's gradient per
step. `unstack` records which tensor the rows came from; `stack` returns that tensor
itself (or the concatenation of several, in order) when the values are exactly its rows,
in order, else `tf.stack(values)`. The record holds weak references only: a traced
function's tensors are never kept alive by it.
"""

from __future__ import annotations

import weakref

import tensorflow as tf

_ROWS: dict[int, tuple] = {}  # id(row) -> (weakref(row), weakref(source), index)


def unstack(source: tf.Tensor, count: int) -> list[tf.Tensor]:
    """tf.unstack(source, count), remembering where each row came from."""
    rows = tf.unstack(source, num=count)
    for dead in [key for key, (row, _, _) in _ROWS.items() if row() is None]:
        del _ROWS[dead]
    for index, row in enumerate(rows):
        _ROWS[id(row)] = (weakref.ref(row), weakref.ref(source), index)
    return rows


def _origin(value):
    entry = _ROWS.get(id(value))
    if entry is None or entry[0]() is not value:
        return None, None
    return entry[1](), entry[2]


def stack(values: list[tf.Tensor]) -> tf.Tensor:
    """tf.stack(values), without a copy where `values` are whole stacked tensors' rows in
    order (one source, or consecutive sources concatenated)."""
    sources, expected = [], 0
    for value in values:
        source, index = _origin(value)
        if source is None or index != expected or (index and source is not sources[-1]):
            return tf.stack(values)
        if index == 0:
            sources.append(source)
        expected = index + 1 if index + 1 < source.shape[0] else 0
    if expected != 0:  # the last source's rows not all there
        return tf.stack(values)
    return sources[0] if len(sources) == 1 else tf.concat(sources, axis=0)
