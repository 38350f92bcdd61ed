"""A record of a run of unknown length in bounded memory: every s-th item, s doubling.

What the outer loop keeps for the whole run (the History of `mgloop.run`, the loop
times the median step time is taken over) grows with the run's length; a run of days
at thousands of steps a minute would keep millions of items. `Thinned`
keeps items 0, s, 2s, ... of everything appended (indices counted from 0), with the
stride s = 1 until `limit` items are kept; then it drops every other kept item and
doubles s. So it holds between limit/2 and limit items, evenly spread over the whole
sequence (one in s), and a statistic over them (a median) is one over a uniform
sample of the run. TensorBoard keeps the full-resolution scalars.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Thinned(Generic[T]):
    """Items of index i with i % stride == 0 of all appended; at most `limit` of them."""

    def __init__(self, limit: int = 4096):
        if limit < 2:
            raise ValueError(f"Thinned: limit={limit}; it must be >= 2")
        self.limit = limit
        self.stride = 1  # one item kept in `stride` appended
        self.items: list[T] = []
        self.appended = 0  # items appended so far

    def append(self, item: T) -> None:
        if self.appended % self.stride == 0:
            self.items.append(item)
            if len(self.items) == self.limit:  # keep indices 0, 2s, 4s, ...: stride 2s
                del self.items[1::2]
                self.stride *= 2
        self.appended += 1

    def __len__(self) -> int:
        return len(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)
