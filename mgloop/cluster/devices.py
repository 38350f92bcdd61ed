"""Tower devices: parse `--devices`, set up logical CPU devices, name the towers.

Spec grammar (the value of `--devices`):

    auto       every visible GPU; with none, 2 logical CPU devices (simulated towers)
    cpu:N      N logical CPU devices carved out of the host CPU (simulated towers),
               1 <= N <= MAX_LOGICAL_CPUS (64)
    gpu        every visible GPU
    gpu:0,2    the listed GPUs, in that order (tower 0 on the first one listed)

Parsing (`parse`) reads only the *physical* device list, which does not start
TensorFlow's runtime, so it can run during validation. Logical CPU devices must
be configured before the runtime starts; `configure_logical_cpus` does that and
says plainly when it is too late.
"""

from __future__ import annotations

import dataclasses
import os
import re

from absl import logging
import tensorflow as tf

from mgloop.errors import ConfigError

AUTO_SIMULATED_TOWERS = 2
# At most this many logical CPU devices (simulated towers). Each one adds a traced copy of
# the step and, in replicated layouts, a copy of the variables and of their gradients, so
# tracing time and memory grow linearly in it (cpu:1000 had not finished one step after
# 240 s, holding 6.8 GB); 64 is 8x the towers of a common 8-accelerator host, as many as a
# simulation of one host needs, and stays usable: `python -m mgloop.train --model=mlp
# --global_batch_size=128 --train_steps=20 --steps_per_loop=20 --devices=cpu:64` ran in
# 121 s at 1.16 GB peak RSS against 42 s and 0.67 GB with --devices=cpu:2 (2 shared cores,
# run one after the other).
MAX_LOGICAL_CPUS = 64
HOST_DEVICE = "/device:CPU:0"
BFC_CPU_ALLOCATOR_ENV = "TF_CPU_ALLOCATOR_USE_BFC"


@dataclasses.dataclass(frozen=True)
class DeviceRequest:
    """What `--devices` asks for, resolved against the physical devices."""

    kind: str  # "cpu" or "gpu"
    indices: tuple[int, ...]  # logical device indices of that kind, tower order
    towers_per_device: int = 1  # K (--towers_per_device): towers computed together per device

    @property
    def num_devices(self) -> int:
        return len(self.indices)

    @property
    def num_towers(self) -> int:
        """T = devices x K."""
        return len(self.indices) * self.towers_per_device

    @property
    def simulated(self) -> bool:
        return self.kind == "cpu"


@dataclasses.dataclass(frozen=True)
class DeviceSet:
    """The devices a run uses: one tower per entry of `towers`, plus the host. With
    --towers_per_device=K each device is listed K times in a row (towers d K .. d K + K - 1
    on device d, computed together: vectorized_towers.py)."""

    towers: tuple[str, ...]
    host: str = HOST_DEVICE
    simulated: bool = True

    @property
    def num_towers(self) -> int:
        return len(self.towers)

    @property
    def towers_per_device(self) -> int:
        """K: towers listed per device (--towers_per_device)."""
        return len(self.towers) // len(self.copy_devices)

    @property
    def copy_devices(self) -> tuple[str, ...]:
        """The distinct tower devices in tower order: where a replicated layout keeps its
        copies (one per device; the towers of one device read the same copy)."""
        return tuple(dict.fromkeys(self.towers))


def _visible_gpus() -> int:
    return len(tf.config.list_physical_devices("GPU"))


def parse(spec: str, towers_per_device: int = 1) -> DeviceRequest:
    return dataclasses.replace(_parse(spec), towers_per_device=towers_per_device)


def _parse(spec: str) -> DeviceRequest:
    """Parses and checks a `--devices` spec against the visible hardware; with
    `towers_per_device` K (checked >= 1 by the caller) each device holds K towers.

    Raises ConfigError (one line naming `--devices` and what is valid) for a
    malformed spec or a GPU that is not there; never falls back silently.
    """
    valid = f"valid: auto, cpu:N (1 <= N <= {MAX_LOGICAL_CPUS}), gpu, gpu:I[,J...]"
    spec = (spec or "").strip().lower()
    if spec == "auto":
        gpus = _visible_gpus()
        if gpus:
            return DeviceRequest("gpu", tuple(range(gpus)))
        return DeviceRequest("cpu", tuple(range(AUTO_SIMULATED_TOWERS)))
    match = re.fullmatch(r"cpu:(\d+)", spec)
    if match:
        count = int(match.group(1))
        if count < 1:
            raise ConfigError(f"--devices={spec}: needs at least one CPU device ({valid})")
        if count > MAX_LOGICAL_CPUS:
            raise ConfigError(
                f"--devices={spec}: at most {MAX_LOGICAL_CPUS} logical CPU devices (each "
                "simulated tower adds its own copy of the step, and of the variables and "
                f"gradients); use --devices=cpu:N with N <= {MAX_LOGICAL_CPUS}")
        return DeviceRequest("cpu", tuple(range(count)))
    match = re.fullmatch(r"gpu(?::(\d+(?:,\d+)*))?", spec)
    if not match:
        raise ConfigError(f"--devices={spec!r} is not understood ({valid})")
    gpus = _visible_gpus()
    if gpus == 0:
        raise ConfigError(
            f"--devices={spec}: no GPU is visible to TensorFlow on this machine; "
            "use --devices=cpu:N to simulate N towers on the CPU")
    if match.group(1) is None:
        return DeviceRequest("gpu", tuple(range(gpus)))
    indices = tuple(int(i) for i in match.group(1).split(","))
    if len(set(indices)) != len(indices):
        raise ConfigError(f"--devices={spec}: a GPU is listed twice; list each once "
                          "(e.g. --devices=gpu:0,1)")
    missing = [i for i in indices if i >= gpus]
    if missing:
        raise ConfigError(
            f"--devices={spec}: GPU {missing[0]} does not exist; list GPUs among the "
            f"visible 0..{gpus - 1}, or give --devices=gpu (every visible GPU)")
    return DeviceRequest("gpu", indices)


def configure_logical_cpus(count: int) -> None:
    """Splits the host CPU into at least `count` logical devices.

    Must run before TensorFlow's runtime starts (before the first op or
    `tf.config.list_logical_devices`). If the runtime already has `count` or
    more logical CPUs this is a no-op, so a test process can configure the
    largest count once (conftest) and use any smaller one.

    It also turns on TensorFlow's BFC allocator for host memory
    (`TF_CPU_ALLOCATOR_USE_BFC=true`, unless the environment already sets the
    variable): every tower computes a full-size gradient each step, and the
    default allocator gives tensors of more than a few MB fresh pages from the
    kernel (mmap) and returns them (munmap), so each step pays page faults and
    zeroing for every such tensor; BFC keeps and reuses freed memory
    (docs/results/systems.md: 2.3x faster steps for big_mlp on 4 towers).
    """
    os.environ.setdefault(BFC_CPU_ALLOCATOR_ENV, "true")  # read when the runtime starts
    cpu = tf.config.list_physical_devices("CPU")[0]
    configured = tf.config.get_logical_device_configuration(cpu)
    if configured is not None and len(configured) >= count:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
    except RuntimeError:
        existing = len(tf.config.list_logical_devices("CPU"))
        if existing >= count:
            return
        raise ConfigError(
            f"--devices=cpu:{count}: TensorFlow's runtime already started with {existing} "
            f"CPU device(s); call mgloop.configure_logical_cpus({count}) before any "
            "TensorFlow op runs (at the top of the script, or once in conftest.py)") from None


def setup(request: DeviceRequest, workers=None, startup_timeout: float = 60.0) -> DeviceSet:
    """Creates the devices of a parsed request and returns their names.

    With a cluster (`mgloop.cluster.workers.Cluster`), also starts this worker's server
    and waits (at most `startup_timeout` seconds) for every peer; the device
    names are then this worker's: `/job:worker/replica:0/task:<i>/device:...`
    """
    if request.simulated:
        configure_logical_cpus(request.num_devices)
        logging.info("No GPU in use: %d towers are simulated on %d logical CPU devices.",
                     request.num_towers, request.num_devices)
    host = HOST_DEVICE
    if workers is not None:
        from mgloop.cluster import workers as workers_lib
        workers_lib.start(workers)
        workers_lib.wait_for_peers(workers, startup_timeout)
        host = f"{workers.task()}/device:CPU:0"
        logging.info("worker %d of %d (%s)", workers.index, workers.num_workers,
                     "chief" if workers.is_chief else "not the chief")
    names = [d.name for d in tf.config.list_logical_devices(request.kind.upper())]
    towers = tuple(names[i] for i in request.indices for _ in range(request.towers_per_device))
    return DeviceSet(towers=towers, host=host, simulated=request.simulated)


def canonical(device: str) -> str:
    """'/job:localhost/replica:0/task:0/device:CPU:1' and '/device:CPU:1' -> 'CPU:1'."""
    spec = tf.DeviceSpec.from_string(device)
    return f"{spec.device_type}:{spec.device_index}"
