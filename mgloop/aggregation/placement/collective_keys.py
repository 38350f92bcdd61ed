"""The group and instance keys of TensorFlow's collective ops, every family in one place,
so that no two of mgloop's collectives share a key.

A key must be the same on every member of a collective, so each worker draws keys from
these counters in the same order (every worker builds and traces the same functions in
the same order). Families, kept apart by their ranges:

    new_group_key(worker), new_instance_key()   a group of one worker's devices
        (collective.py, step/sync_batch_norm.py): group keys worker x WORKER_KEY_SPAN + n,
        instance keys from 1
    new_worker_group_key(), new_worker_instance_key()   a collective between the workers
        (cross_worker.py, peers.py): both from 10^6
    new_run_time_keys()   a run-time block of 2^16 instance keys from 2^30, one per call site
        of peers.py's all_gather_bytes (the exchange count picks the key in the block)
"""

from __future__ import annotations

import itertools

# Group keys are resolved across every worker of a job, so a group of one worker's devices
# takes a key no other worker's group takes: its worker index times this, plus its own.
WORKER_KEY_SPAN = 100_000
RUN_TIME_BLOCK = 1 << 16

_GROUP_KEYS = itertools.count(1)
_INSTANCE_KEYS = itertools.count(1)
_WORKER_GROUP_KEYS = itertools.count(1_000_000)
_WORKER_INSTANCE_KEYS = itertools.count(1_000_000)
_RUN_TIME_KEYS = itertools.count(1 << 30, RUN_TIME_BLOCK)


def new_group_key(worker: int = 0) -> int:
    """A group key no other collective group of this process, nor of another worker (its
    index `worker`), uses."""
    return worker * WORKER_KEY_SPAN + next(_GROUP_KEYS)


def new_instance_key() -> int:
    """An instance key for one call site (the same on every member of the group)."""
    return next(_INSTANCE_KEYS)


def new_worker_group_key() -> int:
    """A group key of a collective between the workers."""
    return next(_WORKER_GROUP_KEYS)


def new_worker_instance_key() -> int:
    """An instance key of one call site of a collective between the workers."""
    return next(_WORKER_INSTANCE_KEYS)


def new_run_time_keys() -> int:
    """The first of RUN_TIME_BLOCK instance keys of one call site that picks its key while
    the step runs."""
    return next(_RUN_TIME_KEYS)
