"""What experiments/bench.py runs: the systems of `--modes`, checked before any process starts.

An entry of `--modes` is an mgloop `--aggregation` name or a baseline
(bench_systems.BASELINES, MULTI_WORKER_BASELINES), with an optional split:

    MODE          one process, once per T of --towers (single_device: once, on 1 device)
    MODE@T        one process with T devices
    MODE@WxT      W worker processes with T devices each (W >= 2), each with its own
                  TF_CONFIG on loopback ports: mgloop's tower-loop modes (the mode inside
                  each worker, TensorFlow's collective all-reduce between workers) and
                  multi_worker_mirrored, which must be given this way

Every bad entry is refused with one line naming `--modes` (or `--device_kind`)
and what would be valid (PlanError), before any worker process starts.
"""

from __future__ import annotations

import dataclasses
import re

from experiments import bench_systems

SINGLE = "single_device"
MULTI_WORKER_MIRRORED = "multi_worker_mirrored"
DEVICE_KINDS = ("cpu", "gpu")
XLA_BASELINES = ("single_device", "mirrored_ctl")  # take +xla, as mgloop modes do


class PlanError(ValueError):
    """A `--modes`/`--device_kind` setting the harness cannot run; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One system to measure: `workers` processes of `towers` devices each."""

    name: str  # e.g. "mgloop:ring@2x2", "mirrored_ctl@4", "single_device"
    system: str  # "mgloop:<mode>" or a baseline's name
    towers: int  # devices per process
    workers: int = 1

    @property
    def total_towers(self) -> int:
        return self.towers * self.workers

    @property
    def split(self) -> str:
        """'WxT': W processes of T devices."""
        return f"{self.workers}x{self.towers}"


def entries(modes: list[str], towers: list[int], mgloop_modes: dict[str, bool]) -> list[Entry]:
    """The systems of `--modes`; `mgloop_modes` maps each mgloop aggregation to its single_loss."""
    valid = (f"an mgloop aggregation ({', '.join(sorted(mgloop_modes))}) or a baseline "
             f"({', '.join(bench_systems.BASELINES + bench_systems.MULTI_WORKER_BASELINES)}), "
             "optionally @T or @WxT")
    out = []
    for entry in modes:
        mode, at, split = entry.strip().partition("@")
        mode, plus, option = mode.partition("+")
        vectorized = re.fullmatch(r"k([1-9]\d*)", option)
        if plus and not (option == "xla" and (mode in mgloop_modes or mode in XLA_BASELINES)
                         or (vectorized or option == "shard") and mode in mgloop_modes):
            raise PlanError(f"--modes: {entry!r}: after + give xla (each tower's or replica's "
                            "forward and backward compiled by XLA: an mgloop mode or one of "
                            f"{', '.join(XLA_BASELINES)}), kK (an mgloop mode with K towers "
                            "per device, one vectorized pass: ps_cpu+k4@1) or shard (an "
                            "mgloop mode with --shard_update: ring+shard)")
        if mode not in mgloop_modes and mode not in bench_systems.BASELINES + \
                bench_systems.MULTI_WORKER_BASELINES:
            raise PlanError(f"--modes: {mode!r} is not {valid}")
        system = (bench_systems.MGLOOP_PREFIX + mode if mode in mgloop_modes else mode) + (
            "+" + option if plus else "")
        match = re.fullmatch(r"(?:(\d+)x)?(\d+)", split) if at else None
        if at and (not match or int(match.group(2)) < 1 or (match.group(1) and
                                                             int(match.group(1)) < 1)):
            raise PlanError(f"--modes: {entry!r}: the part after @ must be T or WxT with "
                            "W, T >= 1 (e.g. ring@4, ring@2x2)")
        workers = int(match.group(1) or 1) if match else 1
        if mode == MULTI_WORKER_MIRRORED and workers < 2:
            raise PlanError(f"--modes: {entry!r}: give multi_worker_mirrored its workers and "
                            "devices per worker as multi_worker_mirrored@WxT with W >= 2 "
                            "(e.g. multi_worker_mirrored@2x1)")
        if workers > 1 and mode in bench_systems.BASELINES:
            raise PlanError(f"--modes: {entry!r}: {mode} runs in one process; use {mode}@T, "
                            f"or multi_worker_mirrored@WxT for TensorFlow's several-process "
                            "strategy")
        if workers > 1 and mode in mgloop_modes and mgloop_modes[mode]:
            raise PlanError(f"--modes: {entry!r}: {mode} is single-loss and runs in one "
                            "process; use a tower-loop mode across workers (e.g. ring@"
                            f"{split})")
        if mode == SINGLE:
            counts = [1]
        elif match:
            counts = [int(match.group(2))]
        else:
            counts = list(towers)
        for count in counts:
            name = (system if mode == SINGLE else f"{system}@{count}" if workers == 1
                    else f"{system}@{workers}x{count}")
            out.append(Entry(name, system, count, workers))
    names = [e.name for e in out]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise PlanError(f"--modes: {', '.join(repeated)} would run twice; list each system once")
    return out


def check_devices(plan: list[Entry], device_kind: str, visible_gpus: int) -> None:
    """Refuses what the devices of this machine (`visible_gpus` GPUs) cannot run.

    On CPU every process splits the host CPU into logical devices, except that
    MultiWorkerMirroredStrategy uses one CPU device per worker whatever exists
    (TF 2.21, CollectiveAllReduceExtended._initialize_local_devices), so it only
    runs as @Wx1 there. On GPU a one-process system uses gpu:0..T-1 and the W
    processes of a multi-worker system get GPUs w*T..w*T+T-1 each
    (CUDA_VISIBLE_DEVICES), so the largest W*T must be visible.
    """
    if device_kind not in DEVICE_KINDS:
        raise PlanError(f"--device_kind={device_kind!r} is not one of: cpu, gpu")
    if device_kind == "cpu":
        for entry in plan:
            if entry.system == MULTI_WORKER_MIRRORED and entry.towers != 1:
                raise PlanError(
                    f"--modes: {entry.name}: without GPUs MultiWorkerMirroredStrategy uses "
                    "one CPU device per worker (TensorFlow 2.21), not logical CPU devices; "
                    f"use {MULTI_WORKER_MIRRORED}@{entry.workers}x1 (same global batch)")
        return
    if visible_gpus == 0:
        raise PlanError("--device_kind=gpu: no GPU is visible to TensorFlow on this machine; "
                        "use --device_kind=cpu (logical CPU devices)")
    largest = max(plan, key=lambda e: e.total_towers)
    if largest.total_towers > visible_gpus:
        raise PlanError(f"--device_kind=gpu: {largest.name} needs {largest.total_towers} GPUs, "
                        f"{visible_gpus} visible; use smaller --towers or splits")


def check_batch(plan: list[Entry], global_batch: int, model: str) -> None:
    """Every system's towers (all workers') must split the global batch evenly."""
    for entry in plan:
        if global_batch % entry.total_towers:
            raise PlanError(f"--global_batch_size={global_batch} ({model}) does not split into "
                            f"the {entry.total_towers} devices of {entry.name}; use a multiple "
                            f"of {entry.total_towers}")
