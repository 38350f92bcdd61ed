"""`--partition`: how the training examples are dealt to the run's clients (non-IID shards).

    iid                  (default) no partition: every global batch is B consecutive
                         examples of the epoch's seeded permutation of all N (epochs.py)
    dirichlet:alpha=A    label-Dirichlet shards (A > 0): small A, each client holds few
                         classes; large A, every client close to the overall class mix

Clients are the units the aggregation method sees: the n = --nodes nodes when the method
is between nodes (--nodes > 1 and --method_at auto or nodes; each node's towers then
split the node's shard contiguously), else the n = T towers. With W workers (TF_CONFIG)
each worker is a node, as --nodes=W simulates it in one process: the n = W workers
(--method_at auto or nodes; with auto also for an exact method, whose one collective
between the workers sums within and then between nodes, cross_worker.py), else the
n = W T towers (--method_at=towers), worker w holding towers w T .. w T + T - 1.

Between workers. Every worker deals the same parts (below: a pure function of the
labels, n, A and --seed; the same numpy on every worker, which the launcher's workers on
one machine share) and forms the same global batch, the clients' shards in client order;
it keeps its contiguous B/W slice of it (inputs.py, batch_split.worker_part), which is
its own clients' shards: worker w's is client w's shard (nodes), or the shards of its T
towers' clients w T .. w T + T - 1 (towers). So worker w reads exactly what node w of
--nodes=W reads in one process, and the weights come out bit-equal
(tests/test_nodes_workers.py). Only the chief writes partition.json.

The partition is made once, before training, with numpy's Generator
`rng = np.random.default_rng(--seed)` (the per-class form of the Dirichlet scheme of
Hsu, Qi and Brown 2019, "Measuring the effects of non-identical data distribution for
federated visual classification", as NIID-Bench, ByzFL and the robust-aggregation papers
use it). For each class c = 0 .. C-1 in turn:

    m_c    = the training examples of class c, ascending index, then rng.permutation
    p_c    = rng.dirichlet(A * 1_n)                      (proportions over the n clients)
    b_i    = floor(m * (p_1 + .. + p_i)),  b_0 = 0, b_n = m   (m = |m_c|)
    client i (0-based) gets m_c[b_i : b_(i+1)]

and client i's part P_i is the union over classes, in ascending example index. The draws
are two per class in that order (a class without examples still draws), so the partition
is a pure function of (labels, n, A, seed) for a given numpy version (numpy does not
promise Generator streams across versions). Client i's class counts are logged and
written to <logdir>/partition.json ("class_counts": n rows of C).

Training stream. Each global batch is the clients' shards of b = B/n examples,
concatenated in client order, so tower t reads its contiguous slice (batch_split.tower_split)
and it comes from its client's part only. Client i's shard stream is epochs.py's stream
over P_i alone, with its own seeded permutations: its epoch e visits P_i in the order
argsort(stateless_uniform([|P_i|], seed=fold_in(fold_in([seed, 2], i), e))) (2 keeps it
apart from the augmentation's stream 1), and --drop_remainder applies per client:
true, each of its epochs gives floor(|P_i| / b) shards (its last |P_i| mod b examples
unused that epoch); false, its epochs run on into one another. So clients with more data
take more steps per epoch of their own; every client contributes b examples to every step,
whatever its part's size (the global loss is the mean over the clients' shards, each
weighted b/B, not the mean over the union of their data). Batch s is a pure function of
(seed, s): a resumed run reads what an uninterrupted one reads.

Tiny parts: an empty part is refused (one line naming the client, A and --seed: use a
larger A, another --seed or fewer clients); with --drop_remainder=true a part smaller
than b is refused too (no full shard fits in its epoch), while with false it is read
with repeats (its epochs run on, so a shard may hold an example more than once).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
import tensorflow as tf
from absl import logging

from mgloop.errors import ConfigError

IID = "iid"
DIRICHLET = "dirichlet"
NAMES = (IID, DIRICHLET)
PARTITION_STREAM = 2  # salt of the clients' permutation seeds (base.AUGMENT_STREAM is 1)
FILENAME = "partition.json"


@dataclasses.dataclass(frozen=True)
class Partition:
    name: str
    alpha: float | None = None


def parse(spec: str) -> Partition:
    """`iid` or `dirichlet:alpha=A` -> Partition; one ConfigError line for every mistake."""
    name, colon, text = str(spec).strip().partition(":")
    name = name.strip()
    if name == IID and not text.strip():
        return Partition(IID)
    if name != DIRICHLET:
        raise ConfigError(f"--partition={spec!r} is not one of: iid, dirichlet:alpha=A "
                          "(A > 0, e.g. dirichlet:alpha=0.5)")
    items = [item.strip() for item in text.split(",") if item.strip()]
    key, equals, raw = (items[0].partition("=") if len(items) == 1 else ("", "", ""))
    if len(items) != 1 or key.strip() != "alpha" or not equals:
        raise ConfigError(f"--partition={spec}: dirichlet takes one option, alpha=A (A > 0, "
                          "e.g. dirichlet:alpha=0.5)")
    try:
        alpha = float(raw)
    except ValueError:
        raise ConfigError(f"--partition={spec}: alpha={raw.strip()!r} is not a number; give "
                          "alpha=A with A > 0 (e.g. dirichlet:alpha=0.5)") from None
    if not (math.isfinite(alpha) and alpha > 0):
        raise ConfigError(f"--partition={spec}: alpha={alpha} is out of range: must be a "
                          "finite number > 0")
    return Partition(DIRICHLET, alpha)


def check_spec(spec: str, dataset: str, source_kind: str | None) -> None:
    """--partition=`spec` parses; dirichlet only for a built-in in-memory labelled dataset.
    `source_kind`: None for such a dataset, else why --dataset=`dataset` has no class labels
    to deal (catalog.py)."""
    partition = parse(spec)
    if partition.name == IID:
        return
    if source_kind is not None:
        raise ConfigError(f"--partition={spec} with --dataset={dataset}: "
                          f"{source_kind}, so its examples cannot be dealt by class; use "
                          "--partition=iid or a labelled in-memory dataset (e.g. digits, "
                          "mnist, cifar10, synthetic)")


def clients_of(method_at: str, nodes: int, num_towers: int,
               num_workers: int = 1) -> tuple[int, str]:
    """(n, "nodes" or "towers"): the units the method sees, of --method_at, --nodes and
    the towers over all workers (aggregation/node_settings.py's method_at_nodes in one process;
    with several workers, each worker a node unless --method_at=towers)."""
    if num_workers > 1:
        if method_at == "towers":
            return num_towers, "towers"
        return num_workers, "nodes"
    if nodes > 1 and method_at in ("auto", "nodes"):
        return nodes, "nodes"
    return num_towers, "towers"


def dirichlet_parts(labels: np.ndarray, num_classes: int, clients: int, alpha: float,
                    seed: int) -> list[np.ndarray]:
    """The parts P_0 .. P_(n-1) of the module docstring: int64 example indices, ascending."""
    rng = np.random.default_rng(seed)
    pieces: list[list[np.ndarray]] = [[] for _ in range(clients)]
    for c in range(num_classes):
        members = rng.permutation(np.flatnonzero(labels == c))
        proportions = rng.dirichlet(np.full(clients, float(alpha)))
        bounds = np.floor(len(members) * np.cumsum(proportions)).astype(np.int64)
        bounds = np.concatenate([[0], np.minimum(bounds[:-1], len(members)), [len(members)]])
        for i in range(clients):
            pieces[i].append(members[bounds[i]:bounds[i + 1]])
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in pieces]


def class_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """int64 [n, C]: client i's examples of class c."""
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


def check_parts(parts: list[np.ndarray], shard: int, drop_remainder: bool, spec: str,
                seed: int, unit: str) -> None:
    """Refuses an empty part, or one smaller than its shard when remainders are dropped."""
    n = len(parts)
    for i, part in enumerate(parts):
        client = f"client {i} of the {n} {unit}"
        if len(part) == 0:
            raise ConfigError(f"--partition={spec} with --seed={seed} gives {client} no "
                              "training examples; use a larger alpha, another --seed or "
                              "fewer clients")
        if drop_remainder and len(part) < shard:
            raise ConfigError(f"--partition={spec} with --seed={seed} gives {client} "
                              f"{len(part)} training examples, fewer than its shard of {shard} "
                              "per step, so with --drop_remainder=true no full shard fits in "
                              "its epoch; use --drop_remainder=false (its epochs run on), a "
                              "larger alpha or another --seed")


def client_seed(seed: int, client: int) -> tf.Tensor:
    """fold_in([seed, 2], client): the seed [2] int64 of client `client`'s permutations."""
    return tf.random.experimental.stateless_fold_in(
        tf.constant([seed, PARTITION_STREAM], tf.int64), client)


def client_indices(part: np.ndarray, shard: int, seed: int, client: int, start_step: int = 0,
                   drop_remainder: bool = True) -> tf.data.Dataset:
    """Client `client`'s shards [shard] int32 of example indices (into the whole training
    set), from its step `start_step` on: the stream of the module docstring."""
    n = len(part)
    base = client_seed(seed, client)
    with tf.device("/device:CPU:0"):
        members = tf.constant(part.astype(np.int32))

    def permutation(epoch):
        keys = tf.random.stateless_uniform(
            [n], seed=tf.random.experimental.stateless_fold_in(base, epoch))
        return tf.argsort(keys, stable=True)

    if not drop_remainder or n % shard == 0:
        local = tf.data.Dataset.counter().flat_map(
            lambda epoch: tf.data.Dataset.from_tensor_slices(permutation(epoch)))
        local = local.batch(shard, drop_remainder=True).skip(start_step)
    else:
        per_epoch = n // shard
        first_epoch, offset = divmod(start_step, per_epoch)
        local = tf.data.Dataset.counter(first_epoch).map(
            lambda epoch: tf.reshape(permutation(epoch)[:per_epoch * shard], [per_epoch, shard])
        ).unbatch().skip(offset)
    return local.map(lambda indices: tf.gather(members, indices))


def train_indices(parts: list[np.ndarray], global_batch: int, seed: int, start_step: int = 0,
                  drop_remainder: bool = True) -> tf.data.Dataset:
    """Global batches [global_batch] int32: the clients' shards concatenated, client 0 first."""
    shard = global_batch // len(parts)
    streams = tuple(client_indices(part, shard, seed, i, start_step, drop_remainder)
                    for i, part in enumerate(parts))
    return tf.data.Dataset.zip(streams).map(lambda *shards: tf.concat(shards, 0))


def record(spec: str, seed: int, logdir: str | None, labels: np.ndarray, num_classes: int,
           parts: list[np.ndarray], unit: str, write: bool = True) -> dict:
    """Logs client i's class counts of --partition=`spec` with --seed=`seed` and writes them
    to `logdir`/partition.json (`write`: the chief of several workers, which share the
    logdir; no `logdir`: nothing is written)."""
    counts = class_counts(labels, parts, num_classes)
    report = {"partition": spec, "seed": seed, "clients": len(parts),
              "unit": unit, "examples": [len(p) for p in parts],
              "class_counts": counts.tolist()}
    logging.info("--partition=%s with --seed=%d: class counts of the %d %s (rows: clients, "
                 "columns: classes 0..%d):\n%s", spec, seed, len(parts), unit,
                 num_classes - 1, "\n".join(f"  {i}: {row.tolist()}" for i, row in
                                            enumerate(counts)))
    if logdir and write:
        path = os.path.join(logdir, FILENAME)
        with open(path + ".tmp", "w") as handle:
            json.dump(report, handle)
        os.replace(path + ".tmp", path)
    return report
