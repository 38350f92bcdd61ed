"""The exchange of a step: the towers' gradients in, each copy's gradients out.

    exchange(tower_grads, metrics, home_sums) -> (grads per copy, metrics over every worker)

One of three, chosen when the step is assembled (assemble.py):

    Plain     `Aggregation.reduce_with_metrics`: the method's reduce, and the step's
              metrics (mean loss, metric states) summed over the workers in the same
              collective (as given in one process)
    Packed    the same on buckets of about `pack_bytes` (aggregation/packing.py), for a
              `summable` method: fewer, larger transfers
    HomeSums  the variables in `home_sums` were summed over the towers at their homes
              (hooks/large_gradients.py) and are only scaled; the others go through the
              method's reduce (ordered_sum.reduce). One process only: metrics as given.
"""

from __future__ import annotations

from mgloop.aggregation import Aggregation
from mgloop.aggregation import packing
from mgloop import ordered_sum


class Plain:
    def __init__(self, aggregation: Aggregation, copies, average: bool):
        self.aggregation, self.copies, self.average = aggregation, copies, average

    def __call__(self, tower_grads, metrics, home_sums):
        return self.aggregation.reduce_with_metrics(tower_grads, self.copies[0].trainable,
                                                    self.average, metrics)


class Packed(Plain):
    def __init__(self, aggregation: Aggregation, copies, average: bool, pack_bytes: int):
        super().__init__(aggregation, copies, average)
        self.pack_bytes = pack_bytes

    def __call__(self, tower_grads, metrics, home_sums):
        variables = self.copies[0].trainable
        buckets = packing.plan(tower_grads[0], self.pack_bytes)
        packed = [packing.pack(grads, buckets, device)
                  for grads, device in zip(tower_grads, self.aggregation.devices.towers)]
        reduced, metrics = self.aggregation.reduce_with_metrics(
            packed, [variables[b[0]] for b in buckets], self.average, metrics)
        shapes = [v.shape for v in variables]
        return [packing.unpack(values, buckets, shapes, copy.device)
                for values, copy in zip(reduced, self.copies)], metrics


class HomeSums(Plain):
    def __call__(self, tower_grads, metrics, home_sums):
        return (ordered_sum.reduce(self.aggregation, tower_grads, self.copies[0].trainable,
                                   home_sums, self.average), list(metrics))


def make(aggregation: Aggregation, copies, average: bool, pack_bytes: int,
         sums_at_home: bool):
    """The exchange for these settings: home sums if a large-gradient hook forms any, else
    packed if asked and the method is summable, else plain."""
    if sums_at_home:
        return HomeSums(aggregation, copies, average)
    if pack_bytes and aggregation.exchanges and aggregation.summable:
        return Packed(aggregation, copies, average, pack_bytes)
    return Plain(aggregation, copies, average)
