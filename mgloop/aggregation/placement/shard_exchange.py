"""The exchange of a sharded update (ZeRO stage 1): a reduce-scatter, then an all-gather.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", stage 1 (PyTorch's ZeroRedundancyOptimizer, DeepSpeed's ZeRO-1): the T
replicated copies split the update instead of each making it whole. With the towers'
gradients of a segment of copy 0's trainable variables flattened into one vector of n
entries (step/sharded_update.py's `Layout`), cut into T contiguous chunks (`shard_sizes`,
in flat order),

    1. reduce-scatter: copy c receives the mean over every tower of its own chunk
       k = owned_shard(c):  m[k] = (1/T) sum_t g[t][k]     (only that chunk, on c's device)
    2. copy c's optimizer, which holds state for chunk k alone, updates chunk k of the
       weights (an element-wise optimizer: the same entries as a whole update, bit for bit);
    3. all-gather: every copy receives every updated chunk and writes its whole copy.

Each device holds 1/T of the optimizer state. Across workers (cross_worker.py's
`ShardedCrossWorker`) each worker's copies split the update the same way and the W
copies holding a chunk add it in a collective of their own: sharded within a worker,
replicated across workers. A method that can do this subclasses
`ShardsUpdate` (ring.py, collective.py, hierarchical.py) and implements the two halves;
step/sharded_update.py builds the update on them.
"""

from __future__ import annotations

import abc

import tensorflow as tf


class ShardsUpdate(abc.ABC):
    """The two halves of an all-reduce, for `--shard_update` (mixed into an Aggregation)."""

    @classmethod
    def sharding_refusal(cls, options, num_towers: int) -> str | None:
        """Why the method with these options cannot shard on `num_towers` towers (the end
        of a one-line refusal), or None."""
        return None

    @abc.abstractmethod
    def shard_sizes(self, num_elements: int) -> list[int]:
        """The sizes of the T chunks of a flat vector of `num_elements`, in flat order."""

    @abc.abstractmethod
    def owned_shard(self, copy: int) -> int:
        """The chunk copy `copy` holds summed after `reduce_scatter` and updates."""

    @abc.abstractmethod
    def reduce_scatter(self, flats: list[tf.Tensor], average: bool) -> list[tf.Tensor]:
        """flats[t] (1-D, on tower t's device) -> per copy c, on its device, the sum over
        the towers of its chunk owned_shard(c) (scaled by 1/T if `average`)."""

    @abc.abstractmethod
    def all_gather(self, chunks: list[tf.Tensor]) -> list[tf.Tensor]:
        """chunks[c] (copy c's owned chunk, on its device) -> per copy, on its device, the
        whole flat vector: every chunk in flat order."""

    def sum_metrics(self, metrics: list[tf.Tensor]) -> list[tf.Tensor]:
        """The step's metrics summed over the workers (one process: as given)."""
        return list(metrics)

    def shard_bounds(self, num_elements: int) -> list[tuple[int, int]]:
        """[start, end) of each chunk in flat order."""
        bounds, start = [], 0
        for size in self.shard_sizes(num_elements):
            bounds.append((start, start + size))
            start += size
        return bounds


def padded_size(num_elements: int, num_chunks: int) -> int:
    """The size of each of `num_chunks` equal chunks covering `num_elements` (the last ones
    padded): what a collective that splits a tensor evenly needs."""
    return -(-num_elements // num_chunks)


def equal_shard_sizes(num_elements: int, num_chunks: int) -> list[int]:
    """The real sizes of equal chunks of `padded_size` over `num_elements` (the padding of
    the last chunks left out; a chunk past the end is empty)."""
    size = padded_size(num_elements, num_chunks)
    return [max(0, min(size, num_elements - k * size)) for k in range(num_chunks)]
