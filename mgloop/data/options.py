"""What a run reads and how it reaches the towers: the data part of the settings
(`config.data`). Exactly one of the two batch sizes may be set; the global batch is the
unit (default 128 when neither is set).

Data only, plain Python (no TensorFlow): `mgloop.runs.config` composes this part into
`Config` and the flags are made from its fields (settings.py); its check is checks.py's.
"""

from __future__ import annotations

import dataclasses

from mgloop.settings import setting

STAGING_MODES = ("none", "host", "device")
# the global batch when neither --global_batch_size nor --batch_size_per_tower is set
DEFAULT_GLOBAL_BATCH_SIZE = 128


@dataclasses.dataclass(frozen=True)
class DataOptions:
    """What a run reads and how it reaches the towers (`config.data`)."""

    dataset: str = setting("synthetic", "one of: {choices} (cifar10, mnist, text: files in "
                           "--data_dir; digits: the bundled UCI 8x8 digits, python_text: the "
                           "standard library's modules as bytes, installed with Python)",
                           hparam=True)
    data_dir: str | None = setting(
        None, "folder of the --dataset files: cifar10 reads data_batch_1.bin .. "
        "data_batch_5.bin and test_batch.bin (binary version); mnist reads "
        "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
        "t10k-labels-idx1-ubyte (each may be .gz); text reads every UTF-8 file under it",
        neutral="where the files of --dataset are (recorded: dataset); data/checks.py verifies them")
    partition: str = setting(
        "iid", "how the training examples are dealt to the clients (the nodes when the "
        "method is between nodes, else the towers): iid (every batch from the whole set) | "
        "dirichlet:alpha=A (label-Dirichlet non-IID parts, class c split by "
        "p_c ~ Dir(A 1_n) drawn with --seed; each client's shard of every batch comes from "
        "its own part; mgloop/data/partition.py)", hparam=True)
    sequence_length: int | None = setting(
        None, "--dataset=text or python_text: tokens (bytes) per sequence (default 64)",
        hparam=True)
    global_batch_size: int | None = setting(
        None, f"examples per step over all towers (default {DEFAULT_GLOBAL_BATCH_SIZE}); or "
        "set --batch_size_per_tower",
        hparam=True)
    batch_size_per_tower: int | None = setting(
        None, "examples per tower per step; global = this x towers", hparam=True)
    drop_remainder: bool = setting(
        True, "true: each epoch gives floor(N/B) full batches, its last N mod B examples "
        "unused; false: epochs run on into one another, so the last batch of an epoch is "
        "completed from the next (every batch is full); for a user's data (tf.data, arrays, "
        "a --plugin dataset) false pads the short batch and weighs it to the mean over its "
        "real examples (mgloop/data/padding.py)", hparam=True)
    staging: str = setting(
        "device", "how batches reach the towers: {choices} (none: synchronous feed; host: "
        "tf.data prefetch; device: host prefetch plus per-tower staging areas)",
        choices=STAGING_MODES, hparam=True)
    staging_depth: int = setting(
        2, "K: batches prefetched on the host (host, device) and staged on every tower "
        "(device); >= 1", hparam=True)

