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
import math
import os
import tempfile

from absl import logging

from mgloop import aggregation
from mgloop import checkpoint
from mgloop import cluster
from mgloop import data
from mgloop import devices
from mgloop import models
from mgloop import ordered_sum
from mgloop import sufficient_factors
from mgloop import precision
from mgloop import sync_batch_norm
from mgloop import staging
from mgloop.errors import ConfigError

OPTIMIZERS = ("sgd", "momentum", "adam")
GRAD_REDUCE = aggregation.validation.GRAD_REDUCE
TRANSPORT_DTYPES = aggregation.validation.TRANSPORT_DTYPES
LR_SCHEDULES = ("constant", "poly", "cosine")
DEFAULT_GLOBAL_BATCH_SIZE = 128
MIN_PEER_TIMEOUT = 5.0  # seconds: the shortest --collective_timeout (see _check_cluster)
CONFIG_FILENAME = "config.json"  # written into the logdir when a run starts
# Settings a resumed run must keep, as a change would silently make it another run than
# the one its checkpoint continues:
# - model, optimizer, mixed_precision shape the checkpointed variables (the loss scale of
#   mixed_float16 lives in the optimizer);
# - dataset and seed are the data: the synthetic task is generated from the seed, and for
#   every dataset the seed is the epochs' permutation, so another seed would make step s
#   read examples the run has already used in this epoch and skip others;
# - global_batch_size, accumulation_steps and drop_remainder fix what step s reads (global
#   batches s*K .. s*K+K-1 of the stream cut per --drop_remainder, data/epochs.py): another
#   value resumes at another place of the stream, and another global batch also means
#   another gradient noise and learning rate per example.
# The others (learning rate, schedule, momentum, weight decay, devices, aggregation,
# data_dir of the same dataset, train_steps, ...) may change: a resume lists those that
# differ in one log line. The tower count and layout do not enter a checkpoint.
CHECKPOINT_SHAPING = ("model", "dataset", "optimizer", "mixed_precision", "accumulation_steps",
                      "seed", "global_batch_size", "drop_remainder")
# numpy's seed (keras.utils.set_random_seed seeds numpy, Python and TensorFlow) is 32 bits.
MAX_SEED = 2**32 - 1


@dataclasses.dataclass(frozen=True)
class Config:
    """Settings of one training run. Field names are the flag names."""

    # Devices and aggregation.
    devices: str = "auto"
    # a method and its options: "NAME" or "NAME:key=value,..." (aggregation/options.py)
    aggregation: str = "reduce_broadcast"
    # modules imported before validation, e.g. registering methods (aggregation/plugins.py)
    plugins: tuple[str, ...] = ()
    grad_reduce: str = "mean"  # "sum": leave out the 1/T (an explicit choice)
    pack_bytes: int = 0  # fuse gradients into buckets of at most this many bytes; 0: off
    transport_dtype: str = "float32"  # dtype of gradients in flight; sums stay float32
    # shared layout on logical CPU towers: gradients of variables of at least this many
    # bytes are summed tower by tower (ordered_sum.py); 0: off
    ordered_sum_bytes: int = ordered_sum.DEFAULT_MIN_BYTES
    # the same towers: a dense kernel of at least this many bytes gets its gradient as one
    # product of the towers' factors at its home (sufficient_factors.py); 0: off
    sufficient_factor_bytes: int = sufficient_factors.DEFAULT_MIN_BYTES
    # Accumulation, precision and batch norm (apply across modes).
    accumulation_steps: int = 1  # micro-batches (global batches) per update
    mixed_precision: str = "none"  # none | mixed_float16 | mixed_bfloat16
    batch_norm: str = "per_tower"  # per_tower | sync (statistics over the global batch)
    # Data and model. Exactly one of the two batch sizes may be set; the global
    # batch is the unit (default 128 when neither is set).
    dataset: str = "synthetic"
    data_dir: str | None = None  # folder of a file dataset's files (cifar10, mnist)
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
    # Inspection (diagnostics.py): TensorBoard beyond the basic scalars.
    diagnostics: bool = False  # per-tower loss/grad norm, gradient agreement, divergence
    eval_every: int = 0  # steps between held-out evaluations (0: only at the end)
    histogram_every: int = 0  # steps between weight and gradient histograms (0: none)
    profile_steps: str | None = None  # "A,B": profiler trace of steps A+1 .. B
    breakdown_every: int = 0  # steps between profiled steps for the step-time breakdown
    # Repeatability.
    seed: int = 0
    deterministic: bool = False
    # Several processes (TF_CONFIG): how long to wait for peers.
    startup_timeout: float = 60.0  # seconds to wait for every peer's server at start
    collective_timeout: float = 30.0  # peer health timeout: seconds a silent peer is waited for

    @property
    def num_towers(self) -> int:
        """Tower count of a validated config (global batch / per-tower batch)."""
        return self.global_batch_size // self.batch_size_per_tower

    def validated(self) -> "Config":
        """Checks every setting; returns a copy with machine-dependent defaults resolved."""
        for field in dataclasses.fields(self):  # NaN and inf pass every comparison
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"--{field.name}={value} is not a finite number")
        request = devices.parse(self.devices)
        workers = cluster.from_environment()
        towers = request.num_towers * (workers.num_workers if workers else 1)
        aggregation.check_settings(self, request, workers)  # loads --plugin modules first
        _check_choice("model", self.model, models.names())
        _check_choice("dataset", self.dataset, data.names())
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _check_choice("staging", self.staging, staging.MODES)
        _check_range("staging_depth", self.staging_depth, low=1)
        devices_flag = self.devices if workers is None else (
            f"{self.devices} on each of {workers.num_workers} workers")
        global_batch = _resolve_global_batch(
            self.global_batch_size, self.batch_size_per_tower, towers, devices_flag)
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
        _check_inspection(self)
        _check_range("seed", self.seed, low=0, high=MAX_SEED)
        if self.warmup_steps > self.train_steps:
            raise ConfigError(
                f"--warmup_steps={self.warmup_steps} is longer than --train_steps="
                f"{self.train_steps}; use at most {self.train_steps}")
        _check_aggregation_options(self)
        _check_cluster(self, workers)
        data_dir = os.path.expanduser(self.data_dir) if self.data_dir is not None else None
        data.check(self.dataset, data_dir)
        logdir = self.logdir or _fresh_logdir()
        _check_writable_dir("logdir", logdir, create=True)
        if self.export_dir is not None:
            _check_writable_dir("export_dir", self.export_dir, create=False)
        resolved = dataclasses.replace(
            self, logdir=logdir, data_dir=data_dir, global_batch_size=global_batch,
            plugins=aggregation.plugins.plugin_list(self.plugins),
            batch_size_per_tower=global_batch // towers)
        _check_resumable(resolved)
        return resolved


def _check_cluster(config: Config, workers: cluster.Cluster | None) -> None:
    """What several processes cannot do (yet), refused before anything starts."""
    _check_range("startup_timeout", config.startup_timeout, low=0.0, low_open=True)
    # A peer is declared lost after this many seconds without an answer to the health checks,
    # made every max(0.5, timeout / 4) s (peer_health.py): under 5 s, four checks in a row of
    # a loaded but healthy peer could miss, so shorter timeouts are refused.
    _check_range("collective_timeout", config.collective_timeout, low=MIN_PEER_TIMEOUT)
    if workers is None or workers.num_workers == 1:
        return
    where = f"across {workers.num_workers} workers (TF_CONFIG)"  # the method: check_settings
    if config.batch_norm == "sync":
        raise ConfigError(f"--batch_norm=sync {where}: statistics are synchronised across one "
                          "worker's towers only; use --batch_norm=per_tower")
    if config.mixed_precision == "mixed_float16":
        raise ConfigError(f"--mixed_precision=mixed_float16 {where}: the overflow check is "
                          "not yet agreed between workers; use mixed_bfloat16 or none")


def _check_aggregation_options(config: Config) -> None:
    """Options that apply across modes; the aggregation's own settings and what combines
    with the method are checked by aggregation.check_settings (aggregation/validation.py)."""
    _check_range("ordered_sum_bytes", config.ordered_sum_bytes, low=0)
    _check_range("sufficient_factor_bytes", config.sufficient_factor_bytes, low=0)
    _check_range("accumulation_steps", config.accumulation_steps, low=1)
    _check_choice("mixed_precision", config.mixed_precision, precision.POLICIES)
    _check_choice("batch_norm", config.batch_norm, sync_batch_norm.MODES)


def _check_inspection(config: Config) -> None:
    """--diagnostics, --eval_every, --histogram_every, --profile_steps, --breakdown_every."""
    _check_range("eval_every", config.eval_every, low=0)
    _check_range("histogram_every", config.histogram_every, low=0)
    _check_range("breakdown_every", config.breakdown_every, low=0)
    if config.profile_steps is not None:
        parse_profile_steps(config.profile_steps, config.train_steps)


def parse_profile_steps(value: str, train_steps: int) -> tuple[int, int]:
    """--profile_steps="A,B" -> (A, B) with 0 <= A < B <= train_steps."""
    parts = value.split(",")
    try:
        first, last = (int(p) for p in parts) if len(parts) == 2 else (None, None)
    except ValueError:
        first = last = None
    if first is None or not 0 <= first < last <= train_steps:
        raise ConfigError(f"--profile_steps={value!r} must be two steps A,B with "
                          f"0 <= A < B <= --train_steps={train_steps} (the trace covers steps "
                          "A+1 .. B)")
    return first, last


def _check_choice(flag: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"--{flag}={value!r} is not one of: {', '.join(sorted(choices))}")


def _check_range(flag, value, low=None, high=None, low_open=False, high_open=False):
    """`value` within the bounds; NaN and inf are refused before, for every float field
    (`Config.validated`), as they pass every comparison."""
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


def _check_resumable(config: Config) -> None:
    """Refuses to resume checkpoints made with other CHECKPOINT_SHAPING settings (compared
    with the logdir's config.json, the resolved settings of the run that wrote them); logs
    one line listing the other settings that differ."""
    logdir = config.logdir
    if not checkpoint.holds_checkpoints(os.path.join(logdir, "checkpoints")):
        return
    try:
        with open(os.path.join(logdir, CONFIG_FILENAME)) as handle:
            previous = json.load(handle)
    except (OSError, ValueError):
        return  # no record to compare: the restore itself checks the variables
    for name in CHECKPOINT_SHAPING:
        if name in previous and previous[name] != getattr(config, name):
            raise ConfigError(
                f"--{name}={getattr(config, name)!r} differs from {previous[name]!r} of the "
                f"checkpoints in --logdir={logdir}; resume with --{name}={previous[name]} "
                "or use a fresh --logdir")
    changed = [f"--{field.name}={getattr(config, field.name)} (was {previous[field.name]})"
               for field in dataclasses.fields(config)
               if field.name in previous and previous[field.name] != getattr(config, field.name)]
    if changed:
        logging.info("resuming the checkpoints in --logdir=%s with settings that differ from "
                     "their run: %s", logdir, ", ".join(changed))


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
