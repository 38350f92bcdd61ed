"""The exchange of a step: the towers' gradients in, each copy's gradients out.

    exchange(tower_grads, metrics, home_sums) -> (grads per copy, metrics over every worker)

One of three, chosen when the step is assembled (assemble.py):

    Plain     `Aggregation.reduce_with_metrics`: the method's reduce, and the step's
              metrics (mean loss, metric states) summed over the workers in the same
              collective (as given in one process)
    Packed    the same on buckets of about `pack_bytes` (aggregation/kernels/packing.py), for a
              `summable` method: fewer, larger transfers
    HomeSums  the variables in `home_sums` were summed over the towers at their homes
              (hooks/large_gradients.py) and are only scaled; the others go through the
              method's reduce (ordered_sum.reduce). One process only: metrics as given.

or, with --shard_update, `Sharded`: each copy's owned chunk of the mean, for its sharded
update (sharded_update.py). The others are inside `SparseRows`, which first decides what
becomes of the towers' sparse gradients
(an Embedding's IndexedSlices, sparse_gradients.py): kept as rows where that moves
fewer bytes (sent home through the method, or all-gathered apart from it), else made
dense on their towers.
"""

from __future__ import annotations

from mgloop.aggregation import Aggregation
from mgloop.aggregation.kernels import packing
from mgloop.step import ordered_sum
from mgloop.step import sparse_gradients


class Plain:
    def __init__(self, aggregation: Aggregation, copies, average: bool):
        self.aggregation, self.copies, self.average = aggregation, copies, average

    def __call__(self, tower_grads, metrics, home_sums, variables=None):
        """`variables`: the variables tower_grads[t] belong to (default: every trainable)."""
        variables = self.copies[0].trainable if variables is None else variables
        return self.aggregation.reduce_with_metrics(tower_grads, variables, self.average,
                                                    metrics)


class Packed(Plain):
    """Rows kept sparse (sparse_gradients.py, home route) are not packed: each goes to the
    method as it is, a bucket of its own."""

    def __init__(self, aggregation: Aggregation, copies, average: bool, pack_bytes: int):
        super().__init__(aggregation, copies, average)
        self.pack_bytes = pack_bytes

    def __call__(self, tower_grads, metrics, home_sums, variables=None):
        variables = self.copies[0].trainable if variables is None else variables
        first = tower_grads[0]
        rows = [i for i, g in enumerate(first) if sparse_gradients.is_sparse(g)]
        dense = [i for i in range(len(first)) if i not in rows]
        buckets = [[dense[j] for j in bucket]
                   for bucket in packing.plan([first[i] for i in dense], self.pack_bytes)]
        packed = [packing.pack(grads, buckets, device) + [grads[i] for i in rows]
                  for grads, device in zip(tower_grads, self.aggregation.devices.towers)]
        reduced, metrics = self.aggregation.reduce_with_metrics(
            packed, [variables[b[0]] for b in buckets] + [variables[i] for i in rows],
            self.average, metrics)
        shapes = [v.shape for v in variables]
        out = []
        for values, copy in zip(reduced, self.copies):
            grads = packing.unpack(values[:len(buckets)], buckets, shapes, copy.device)
            for i, value in zip(rows, values[len(buckets):]):
                grads[i] = value
            out.append(grads)
        return out, metrics


class HomeSums(Plain):
    def __call__(self, tower_grads, metrics, home_sums, variables=None):
        return (ordered_sum.reduce(self.aggregation, tower_grads, self.copies[0].trainable,
                                   home_sums, self.average), list(metrics))


class SparseRows:
    """Around an exchange: the towers' IndexedSlices gradients (an Embedding's) kept as rows
    where that moves fewer bytes, made dense on their towers elsewhere (sparse_gradients.py).
    On the all-gather route the kept variables bypass `inner` (every copy adds every
    tower's rows); on the home route they go through it to the method's `send`."""

    def __init__(self, inner, plan: sparse_gradients.Plan):
        self.inner, self.plan = inner, plan
        self.aggregation, self.copies, self.average = inner.aggregation, inner.copies, inner.average

    def __call__(self, tower_grads, metrics, home_sums):
        tower_grads = self.plan.prepare(tower_grads, excluded=home_sums)
        kept = self.plan.kept
        if self.plan.route != sparse_gradients.ALL_GATHER or not kept:
            return self.inner(tower_grads, metrics, home_sums)
        variables = self.copies[0].trainable
        rest = [i for i in range(len(variables)) if i not in kept]
        out = [[None] * len(variables) for _ in self.copies]
        if rest:
            reduced, metrics = self.inner([[grads[i] for i in rest] for grads in tower_grads],
                                          metrics, home_sums, [variables[i] for i in rest])
            for copy, values in zip(out, reduced):
                for i, value in zip(rest, values):
                    copy[i] = value
        else:
            metrics = list(metrics)
        for i in kept:
            per_copy = self.plan.all_gather(tower_grads, i, [c.device for c in self.copies],
                                            self.average)
            for copy, value in zip(out, per_copy):
                copy[i] = value
        return out, metrics


class Sharded:
    """--shard_update: the method's reduce-scatter of the towers' flattened gradients (sparse
    ones made dense), per copy its owned chunk of the mean; the metrics summed over the
    workers (`sum_metrics`: as given in one process)."""

    def __init__(self, sharded_update, average: bool):
        self.sharded_update, self.average = sharded_update, average

    def __call__(self, tower_grads, metrics, home_sums):
        del home_sums  # (none: a replicated layout sums nothing at a home)
        chunks = self.sharded_update.exchange(tower_grads, self.average)
        return chunks, self.sharded_update.method.sum_metrics(metrics)


def make(aggregation: Aggregation, copies, average: bool, pack_bytes: int,
         sums_at_home: bool, sparse_as_dense: bool = False, sharded_update=None):
    """The exchange for these settings: `Sharded` with a sharded update, else home sums if
    a large-gradient hook forms any, else packed if asked and the method is summable, else
    plain; inside `SparseRows`, which decides what becomes of sparse gradients
    (`--sparse_as_dense`)."""
    if sharded_update is not None:
        return Sharded(sharded_update, average)
    if sums_at_home:
        inner = HomeSums(aggregation, copies, average)
    elif pack_bytes and aggregation.capabilities.exchanges and aggregation.capabilities.summable:
        inner = Packed(aggregation, copies, average, pack_bytes)
    else:
        inner = Plain(aggregation, copies, average)
    return SparseRows(inner, sparse_gradients.Plan(aggregation, copies[0].trainable,
                                                   sparse_as_dense))
