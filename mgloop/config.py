"""Every setting of a run, in one frozen dataclass, and the checks it must pass.

`Config.validated()` is the only gate between settings and TensorFlow: it
checks each field and each combination, resolves the defaults that depend on
the machine (tower count, global batch, logdir), and raises `ConfigError` with
one line naming the flag and what would be valid. It creates no device and no
variable; its only side effect is creating the logdir it has checked.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import tempfile

from mgloop import aggregation
from mgloop import data
from mgloop import devices
from mgloop import models
from mgloop import staging
from mgloop.errors import ConfigError

OPTIMIZERS = ("sgd", "momentum", "adam")
LR_SCHEDULES = ("constant", "poly", "cosine")
DEFAULT_GLOBAL_BATCH_SIZE = 128
CONFIG_FILENAME = "config.json"  # written into the logdir when a run starts
# Settings that shape the checkpointed variables: a resumed run must keep them.
CHECKPOINT_SHAPING = ("model", "dataset", "optimizer")


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of one training run. Field names are the flag names."""

    # Devices and aggregation.
    devices: str = "auto"
    aggregation: str = "reduce_broadcast"
    # Data and model. Exactly one of the two batch sizes may be set; the global
    # batch is the unit (default 128 when neither is set).
    dataset: str = "synthetic"
    model: str = "mlp"
    global_batch_size: int | None = None
    batch_size_per_tower: int | None = None
    drop_remainder: bool = True  # per epoch: see mgloop/data/epochs.py
    # Input staging (staging.py): none | host | device, depth K.
    staging: str = "device"
    staging_depth: int = 2
    # Updates.
    optimizer: str = "momentum"
    learning_rate: float = 0.05
    momentum: float = 0.9
    lr_schedule: str = "constant"
    lr_power: float = 1.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    # Loop.
    train_steps: int = 400
    steps_per_loop: int = 20
    # Outputs.
    logdir: str | None = None
    summary_every: int = 20
    log_every: int = 100
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    export_dir: str | None = None
    # Repeatability.
    seed: int = 0
    deterministic: bool = False

    @property
    def num_towers(self) -> int:
        """Tower count of a validated config (global batch / per-tower batch)."""
        return self.global_batch_size // self.batch_size_per_tower

    def validated(self) -> "Config":
        """Checks every setting; returns a copy with machine-dependent defaults resolved."""
        request = devices.parse(self.devices)
        towers = request.num_towers
        _check_choice("aggregation", self.aggregation, aggregation.names())
        _check_choice("model", self.model, models.names())
        _check_choice("dataset", self.dataset, data.names())
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _check_choice("staging", self.staging, staging.MODES)
        _check_range("staging_depth", self.staging_depth, low=1)
        global_batch = _resolve_global_batch(
            self.global_batch_size, self.batch_size_per_tower, towers, self.devices)
        _check_range("learning_rate", self.learning_rate, low=0.0, low_open=True)
        _check_range("momentum", self.momentum, low=0.0, high=1.0, high_open=True)
        _check_range("lr_power", self.lr_power, low=0.0, low_open=True)
        _check_range("weight_decay", self.weight_decay, low=0.0)
        _check_range("train_steps", self.train_steps, low=0)
        _check_range("warmup_steps", self.warmup_steps, low=0)
        _check_range("steps_per_loop", self.steps_per_loop, low=1)
        _check_range("summary_every", self.summary_every, low=0)
        _check_range("log_every", self.log_every, low=0)
        _check_range("checkpoint_every", self.checkpoint_every, low=0)
        _check_range("keep_checkpoints", self.keep_checkpoints, low=1)
        _check_range("seed", self.seed, low=0)
        if self.warmup_steps > self.train_steps:
            raise ConfigError(
                f"--warmup_steps={self.warmup_steps} is longer than --train_steps="
                f"{self.train_steps}; use at most {self.train_steps}")
        aggregation.get(self.aggregation).check(request)
        logdir = self.logdir or _fresh_logdir()
        _check_writable_dir("logdir", logdir, create=True)
        _check_resumable(self, logdir)
        if self.export_dir is not None:
            _check_writable_dir("export_dir", self.export_dir, create=False)
        return dataclasses.replace(
            self, logdir=logdir, global_batch_size=global_batch,
            batch_size_per_tower=global_batch // towers)


def _check_choice(flag: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"--{flag}={value!r} is not one of: {', '.join(sorted(choices))}")


def _check_range(flag, value, low=None, high=None, low_open=False, high_open=False):
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        bounds = []
        if low is not None:
            bounds.append(f"{'>' if low_open else '>='} {low}")
        if high is not None:
            bounds.append(f"{'<' if high_open else '<='} {high}")
        raise ConfigError(f"--{flag}={value} is out of range: must be {' and '.join(bounds)}")


def _resolve_global_batch(global_batch, per_tower, towers, devices_flag) -> int:
    if global_batch is not None and per_tower is not None:
        raise ConfigError("--global_batch_size and --batch_size_per_tower are both set; "
                          "set one (the other follows from the tower count)")
    if per_tower is not None:
        _check_range("batch_size_per_tower", per_tower, low=1)
        return per_tower * towers
    global_batch = DEFAULT_GLOBAL_BATCH_SIZE if global_batch is None else global_batch
    _check_range("global_batch_size", global_batch, low=1)
    if global_batch % towers:
        raise ConfigError(
            f"--global_batch_size={global_batch} does not split into {towers} equal tower "
            f"shards (--devices={devices_flag}); use a multiple of {towers}")
    return global_batch


def _check_resumable(config: Config, logdir: str) -> None:
    """Refuses to resume checkpoints made with a different model, dataset or optimizer."""
    previous_path = os.path.join(logdir, CONFIG_FILENAME)
    if not os.path.exists(os.path.join(logdir, "checkpoints", "checkpoint")):
        return
    try:
        with open(previous_path) as handle:
            previous = json.load(handle)
    except (OSError, ValueError):
        return  # no record to compare: the restore itself checks the variables
    for name in CHECKPOINT_SHAPING:
        if name in previous and previous[name] != getattr(config, name):
            raise ConfigError(
                f"--{name}={getattr(config, name)!r} differs from {previous[name]!r} of the "
                f"checkpoints in --logdir={logdir}; resume with --{name}={previous[name]} "
                "or use a fresh --logdir")


def _fresh_logdir() -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return os.path.join(tempfile.gettempdir(), "mgloop", stamp)


def _check_writable_dir(flag: str, path: str, create: bool) -> None:
    """Refuses a path that is a file or cannot hold files; creates it if asked."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--{flag}={path} is an existing file; give a directory path")
    if not create:
        parent = path
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent.rstrip(os.sep)) or os.sep
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ConfigError(f"--{flag}={path} cannot be created ({parent} is not a "
                              "writable directory)")
        return
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-"):
            pass
    except OSError as error:
        raise ConfigError(f"--{flag}={path} is not a writable directory "
                          f"({error.strerror or error})") from None
