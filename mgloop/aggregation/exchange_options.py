"""How the towers' gradients meet: the aggregation part of the settings
(`config.exchange`): the method, what travels and between which nodes.

Data only, plain Python (no TensorFlow): `mgloop.runs.config` composes this part into
`Config` and the flags are made from its fields (settings.py); its check is checks.py's.
"""

from __future__ import annotations

import dataclasses

from mgloop.settings import setting

GRAD_REDUCE = ("mean", "sum")
TRANSPORT_DTYPES = ("float32", "float16", "bfloat16")
METHOD_AT = ("auto", "nodes", "towers")
DIRECT = "reduce"  # --within_node's default: every tower sends to the leader
DEFAULT_BUCKET_BYTES = 4 * 2 ** 20


@dataclasses.dataclass(frozen=True)
class ExchangeOptions:
    """How the towers' gradients meet (`config.exchange`)."""

    aggregation: str = setting(
        "reduce_broadcast", "how gradients meet: NAME or NAME:key=value,... with the method's "
        "own options (e.g. ring:shards=2, hierarchical:groups=2); NAME one of: {choices}, or "
        "a method a --plugin registers", hparam=True)
    grad_reduce: str = setting(
        "mean", "mean (default: gradient of the mean loss over the global batch) | sum (the "
        "sum over towers, T times larger)", choices=GRAD_REDUCE, hparam=True)
    pack_bytes: int = setting(
        DEFAULT_BUCKET_BYTES, "fuse gradients into buckets of at most this many bytes "
        "before the exchange inside a process (0: off; the default packs for summable methods; "
        "large gradients summed at their home are not packed); a compressor's gathered "
        "payloads travel in buckets of this many bytes, one message each (DDP's "
        "bucket_cap_mb); between workers summed gradients always travel as one buffer per "
        "dtype", hparam=True)
    transport_dtype: str = setting(
        "float32", "float32 | float16 | bfloat16: dtype of gradients in flight; sums are "
        "accumulated in float32", choices=TRANSPORT_DTYPES, hparam=True)
    nodes: int = setting(
        1, "N: split one process's towers into N simulated nodes (contiguous, node-major; "
        "must divide the towers); with several workers each worker is a node",
        hparam=True)
    method_at: str = setting(
        "auto", "{choices}: whether --aggregation sees one gradient per node (each node's "
        "exact mean, summed by --within_node) or one per tower; auto: nodes when --nodes > 1",
        choices=METHOD_AT, hparam=True)
    within_node: str = setting(
        DIRECT, "how a node sums its towers before the method between "
        "nodes: reduce (every tower sends to the node's first, which adds in tower order) or "
        "an exact replicated method's name (e.g. ring, collective)", hparam=True)
    node_failures: str | None = setting(
        None, "simulated nodes that fail (--nodes=N, the method at the nodes): n@a-b (node n "
        "down for steps a <= s < b, back at b with a live node's state) or n@a (gone from "
        "step a), comma-separated, e.g. 2@30-60,1@80; a down node's part is left out of the "
        "mean, its copies frozen (torchft's quorum; aggregation/placement/node_failures.py)",
        hparam=True)
    sparse_as_dense: bool = setting(
        False, "send an Embedding's sparse gradient (IndexedSlices) as a dense tensor "
        "everywhere; false: as rows (values and indices) where that moves fewer bytes: to "
        "the home of a ps_* variable, or all-gathered for a replicated exact method in one "
        "process (sparse_gradients.py)", hparam=True)
    shard_update: bool = setting(
        False, "each replicated copy updates only its chunk of the weights, with the "
        "optimizer state of that chunk alone (ZeRO stage 1): the method's reduce-scatter, "
        "the chunk's update, an all-gather of the weights (ring, collective, hierarchical; "
        "an element-wise optimizer; step/sharded_update.py)", hparam=True)
    plugins: tuple[str, ...] = setting(
        (), "import this module (a name on the Python path, or a .py file path) before "
        "validation (repeatable): it may register aggregation methods", flag="plugin",
        hparam=True)

