"""absl flag definitions for every Config field; nothing else in mgloop defines flags.

`define_flags()` registers one flag per Config field (same name, same default);
`config_from_flags()` reads them back into a Config. Values are checked by
`Config.validated()`, so the CLI and the Python API give the same errors.
"""

from __future__ import annotations

import dataclasses

from absl import flags

from mgloop import aggregation
from mgloop import data
from mgloop import models
from mgloop import staging
from mgloop.config import LR_SCHEDULES, OPTIMIZERS, Config

FLAGS = flags.FLAGS

_HELP = {
    "devices": "auto | cpu:N | gpu | gpu:I,J,... (auto: all GPUs, else 2 simulated CPU towers)",
    "aggregation": f"how gradients meet: NAME or NAME:key=value,... (e.g. ring:shards=2, "
                   f"hierarchical:groups=2); NAME one of {', '.join(aggregation.names())} "
                   "or a method a --plugin registers",
    "plugins": "--plugin=MODULE (repeatable): a module name or .py file imported before the "
               "settings are checked, e.g. to register an aggregation method",
    "grad_reduce": "mean (default: gradient of the mean loss over the global batch) | sum "
                   "(the sum over towers, T times larger)",
    "pack_bytes": "fuse gradients into buckets of at most this many bytes before the "
                  "exchange inside a process (0: off); between workers they always travel "
                  "as one buffer per dtype",
    "ordered_sum_bytes": "shared layout (ps_*) on logical CPU towers: the gradients of each "
                         "variable of at least this many bytes are summed tower by tower, "
                         "tower t's backward pass starting once tower t-1's were added, so "
                         "two copies of them are alive instead of T + 1 (the towers' backward "
                         "passes no longer overlap); 0: off",
    "sufficient_factor_bytes": "shared layout (ps_*) on logical CPU towers: a variable of at "
                               "least this many bytes used by one plain matmul z = x W per "
                               "tower (a float32 Dense kernel) gets its summed gradient as "
                               "one product X^T dZ of the towers' inputs and output gradients "
                               "at its home, instead of one full-size gradient per tower; 0: off",
    "transport_dtype": "float32 | float16 | bfloat16: dtype of gradients in flight; sums are "
                       "accumulated in float32",
    "accumulation_steps": "micro-batches per update: each tower sums its gradients over K "
                          "consecutive global batches before one exchange and one update "
                          "(effective batch K x global batch; --train_steps counts updates)",
    "mixed_precision": "none | mixed_float16 | mixed_bfloat16: Keras dtype policy of the model "
                       "(float32 variables, 16-bit compute); mixed_float16 adds dynamic loss "
                       "scaling, an overflow on any tower skipping the update on all",
    "batch_norm": "per_tower (each tower's shard statistics, moving statistics averaged over "
                  "towers) | sync (batch statistics over the global batch across towers)",
    "dataset": f"one of: {', '.join(data.names())} (cifar10, mnist: files in --data_dir)",
    "data_dir": "folder of the --dataset files: cifar10 reads data_batch_1.bin .. "
                "data_batch_5.bin and test_batch.bin (binary version); mnist reads "
                "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
                "t10k-labels-idx1-ubyte (each may be .gz)",
    "model": f"one of: {', '.join(models.names())}",
    "global_batch_size": "examples per step over all towers (default 128); "
                         "or set --batch_size_per_tower",
    "batch_size_per_tower": "examples per tower per step; global = this x towers",
    "drop_remainder": "true: each epoch gives floor(N/B) full batches, its last N mod B "
                      "examples unused; false: epochs run on into one another, so the last "
                      "batch of an epoch is completed from the next (every batch is full)",
    "staging": f"how batches reach the towers: {', '.join(staging.MODES)} (none: synchronous "
               "feed; host: tf.data prefetch; device: host prefetch plus per-tower staging "
               "areas)",
    "staging_depth": "K: batches prefetched on the host (host, device) and staged on every "
                     "tower (device); >= 1",
    "optimizer": f"one of: {', '.join(OPTIMIZERS)} (momentum: SGD with --momentum)",
    "learning_rate": "peak learning rate",
    "momentum": "momentum of --optimizer=momentum",
    "lr_schedule": f"one of: {', '.join(LR_SCHEDULES)} (poly: Caffe's polynomial decay)",
    "lr_power": "power of the poly schedule",
    "warmup_steps": "steps of linear warm-up before the schedule",
    "weight_decay": "decoupled weight decay (v -= lr * wd * v each update)",
    "train_steps": "train until the global step reaches this (resumes count)",
    "steps_per_loop": "steps run inside one compiled tf.function call",
    "logdir": "run folder for events, checkpoints, summary.json "
              "(default: a fresh timestamped folder under the temp dir)",
    "summary_every": "steps between TensorBoard scalar summaries (0: none)",
    "log_every": "steps between progress log lines (0: none)",
    "checkpoint_every": "steps between checkpoints (0: only at the end of training)",
    "keep_checkpoints": "how many recent checkpoints to keep",
    "export_dir": "save the template model here as model.keras (Keras native format)",
    "diagnostics": "per-tower loss and gradient norm, gradient agreement (cosine, norm ratio) "
                   "and replica divergence in TensorBoard, every --summary_every steps",
    "eval_every": "steps between evaluations on the held-out split (0: only at the end)",
    "histogram_every": "steps between weight and gradient histograms (0: none)",
    "profile_steps": "A,B: write a profiler trace of steps A+1 .. B into <logdir>/plugins/profile",
    "breakdown_every": "steps between profiled steps whose time is split into input, compute, "
                       "aggregation and apply (breakdown/... scalars; 0: none)",
    "seed": "seed of data, initialisation and shuffling",
    "startup_timeout": "several processes (TF_CONFIG): seconds to wait for every peer at start",
    "collective_timeout": "several processes: the peer health timeout: a peer that answers no "
                          "health check for this many seconds (dead, stopped, hung) is declared "
                          "lost within 10s more, the collectives are aborted and the run fails "
                          "(exit code 3 naming it), not hangs; >= 5",
    "deterministic": "TensorFlow op determinism: bit-repeatable runs",
}


def define_flags() -> None:
    """Defines one flag per Config field, once."""
    if "aggregation" in FLAGS:
        return
    for field in dataclasses.fields(Config):
        help_text = _HELP[field.name]
        default = field.default
        if field.name == "plugins":  # repeatable: --plugin=A --plugin=B
            flags.DEFINE_multi_string("plugin", list(default), help_text)
        elif field.type in ("bool",):
            flags.DEFINE_bool(field.name, default, help_text)
        elif field.type in ("int", "int | None"):
            flags.DEFINE_integer(field.name, default, help_text)
        elif field.type == "float":
            flags.DEFINE_float(field.name, default, help_text)
        else:
            flags.DEFINE_string(field.name, default, help_text)


def flag_name(field_name: str) -> str:
    """The flag of a Config field: the field's name, but `--plugin` (repeatable) for `plugins`."""
    return "plugin" if field_name == "plugins" else field_name


def config_from_flags() -> Config:
    values = {field.name: FLAGS[flag_name(field.name)].value
              for field in dataclasses.fields(Config)}
    values["plugins"] = tuple(values["plugins"] or ())
    return Config(**values)
