"""Modelled compute per step for the hardware a user studies: `--compute` and `--node_speeds`.

The link model (link_model.py) sets a step's modelled exchange beside its compute time C.
By default C is measured on this machine (the median step less the exchange timed alone),
which says how fast this CPU is, not the accelerator a study has in mind. `--compute`
chooses C:

    measured                   C = the measured compute (link_model.compute_seconds)
    PROFILE[:efficiency=E]     C = F * b / (P * E)
    seconds=X                  C = X, the compute of one step of one device, given

with F the FLOPs of one example's training step (forward, loss, gradients), counted from
the traced step of the template model (runs/step_flops.py, observe/flops.py: matrix
products and convolutions only), b the examples one tower computes per step (the
per-tower batch times --accumulation_steps: the towers of a node run in parallel, each
an accelerator of the profile, as the link model gives each tower its own link; with
one tower per node, b = global batch / nodes), P the profile's peak dense 16-bit FLOP/s
and E the model FLOPs utilisation (Chowdhery et al. 2022, "PaLM", arXiv 2204.02311,
appendix B: achieved model FLOP/s over the peak; 0 < E <= 1, default 0.4).

Profiles: the vendors' datasheet peaks of dense BF16/FP16 tensor-core arithmetic (no
structured sparsity, which the datasheets quote at twice these):

    a100   312e12   NVIDIA A100 Tensor Core GPU datasheet, BF16/FP16 Tensor Core (SXM4)
    h100   989e12   NVIDIA H100 Tensor Core GPU datasheet, BF16/FP16 Tensor Core (SXM5),
                    1,979 TFLOPS "with sparsity" halved
    v100   125e12   NVIDIA Tesla V100 datasheet, Tensor Performance (SXM2)
    t4      65e12   NVIDIA T4 datasheet, mixed precision (FP16/FP32)
    cpu      1e12   nominal: 16 cores x 2 GHz x 32 FP32 FLOPs per cycle (two AVX-512
                    FMA units of 16 lanes), a server CPU without matrix units

Slow nodes. `--node_speeds=1,1,0.5,1` (one factor per node, N values) makes node n
compute at s_n times the profile's (or the measured, or the given) speed. A synchronous
step waits for its slowest node, and so does every method here: a local method's nodes
meet at its sync, and their steps in between are charged at the same C per step, so

    modelled compute per step = C / min_n s_n

for every method (the simplest model: it does not let a fast node run ahead between
syncs, nor a method drop a straggler), but async_diloco, whose nodes step on their own
clocks and whose global step is the fastest node's: C / max_n s_n (`fastest`).
"""

from __future__ import annotations

import dataclasses

from mgloop.errors import ConfigError

DEFAULT_EFFICIENCY = 0.4
PEAK_FLOPS = {"a100": 312e12, "h100": 989e12, "v100": 125e12, "t4": 65e12, "cpu": 1e12}
MEASURED, PROFILE, GIVEN = "measured", "profile", "given"
_EXAMPLE = "e.g. --compute=a100:efficiency=0.4, --compute=seconds=0.05 or --compute=measured"
_SPEEDS_EXAMPLE = "e.g. --node_speeds=1,1,0.5,1: node 2 at half speed"


@dataclasses.dataclass(frozen=True)
class ComputeSetting:
    """A parsed --compute: `kind` measured | profile | given."""

    kind: str
    profile: str | None = None
    efficiency: float = DEFAULT_EFFICIENCY
    seconds: float | None = None

    @property
    def peak(self) -> float:
        return PEAK_FLOPS[self.profile]


def _number(text: str, what: str, flag: str, example: str = _EXAMPLE) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--{flag}: {what} {text!r} is not a number ({example})") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ConfigError(f"--{flag}: {what} {text!r} is not a finite number")
    return value


def parse(text: str) -> ComputeSetting:
    """`measured`, `PROFILE[:efficiency=E]` or `seconds=X` (module top); ConfigError (one
    line) otherwise."""
    flag = f"compute={text}"
    name, _, options = text.strip().lower().partition(":")
    if name == MEASURED:
        if options:
            raise ConfigError(f"--{flag}: measured takes no options ({_EXAMPLE})")
        return ComputeSetting(MEASURED)
    if name.startswith("seconds="):
        seconds = _number(name.removeprefix("seconds="), "seconds", flag)
        if options or seconds <= 0:
            raise ConfigError(f"--{flag}: give seconds=X with X > 0, the compute seconds of "
                              "one step of one device (e.g. --compute=seconds=0.05)")
        return ComputeSetting(GIVEN, seconds=seconds)
    if name not in PEAK_FLOPS:
        raise ConfigError(f"--{flag}: {name!r} is not measured, seconds=X nor a profile of: "
                          f"{', '.join(PEAK_FLOPS)} ({_EXAMPLE})")
    efficiency = DEFAULT_EFFICIENCY
    if options:
        key, _, value = options.partition("=")
        if key.strip() != "efficiency" or not value:
            raise ConfigError(f"--{flag}: the profile's one option is efficiency=E "
                              f"(0 < E <= 1, default {DEFAULT_EFFICIENCY}), not {options!r}")
        efficiency = _number(value, "efficiency", flag)
        if not 0 < efficiency <= 1:
            raise ConfigError(f"--{flag}: efficiency={efficiency:g} is out of range: the "
                              "model FLOPs utilisation must be > 0 and <= 1")
    return ComputeSetting(PROFILE, profile=name, efficiency=efficiency)


def parse_speeds(text: str | None, num_nodes: int) -> tuple[float, ...]:
    """--node_speeds as one factor > 0 per node; () when not set (None; an empty value is
    refused: the flag's default is None)."""
    if text is None:
        return ()
    if not text.strip():
        raise ConfigError(f"--node_speeds is set but empty; give one speed factor per node "
                          f"({_SPEEDS_EXAMPLE}), or leave --node_speeds out for equal nodes")
    speeds = tuple(_number(part.strip(), "speed", f"node_speeds={text}", _SPEEDS_EXAMPLE)
                   for part in text.split(","))
    if len(speeds) != num_nodes:
        raise ConfigError(f"--node_speeds={text} gives {len(speeds)} speeds for {num_nodes} "
                          f"node{'s' if num_nodes > 1 else ''}: give one factor per node "
                          "(--nodes, or the workers)")
    if min(speeds) <= 0:
        raise ConfigError(f"--node_speeds={text}: every speed must be > 0 (1: the profile's "
                          "speed, 0.5: half of it)")
    return speeds


@dataclasses.dataclass(frozen=True)
class Compute:
    """The compute per step the link model uses, and where it comes from."""

    seconds: float | None  # C / min speed; None: not known (no timed step, F not counted)
    source: str  # "measured" | "profile a100 at 0.4 of 312e12 FLOP/s, F FLOPs ..." | "given"
    measured_seconds: float | None
    flops_per_example: float | None = None
    node_speeds: tuple[float, ...] = ()

    def as_dict(self) -> dict:
        """summary.json link_model's keys beside compute_seconds."""
        return {"compute_source": self.source,
                "measured_compute_seconds": self.measured_seconds,
                "flops_per_example": self.flops_per_example,
                "node_speeds": list(self.node_speeds) or None}


def source_of(setting: ComputeSetting, flops_per_example: float | None,
              examples_per_tower: int | None, speeds: tuple[float, ...],
              fastest: bool = False) -> str:
    """compute_source: which C, in words."""
    if setting.kind == PROFILE:
        text = (f"profile {setting.profile} at {setting.efficiency:g} of "
                f"{setting.peak / 1e12:g}e12 FLOP/s, "
                + (f"{flops_per_example:.6g} FLOPs per example, {examples_per_tower} "
                   "examples per tower step" if flops_per_example is not None
                   else "FLOPs per example not counted"))
    else:
        text = setting.kind
    if speeds and fastest:
        text += f"; paced by the fastest node (speed {max(speeds):g}; async_diloco)"
    elif speeds:
        text += f"; waits for the slowest node (speed {min(speeds):g})"
    return text


def modelled(setting: ComputeSetting, measured: float | None,
             flops_per_example: float | None = None, examples_per_tower: int | None = None,
             speeds: tuple[float, ...] = (), fastest: bool = False) -> Compute:
    """C (module top) for a parsed --compute: the measured C, F * b / (P * E), or the given
    seconds; divided by the slowest node's speed (`fastest`: the fastest's, for a method
    whose global step is the fastest node's, async_diloco)."""
    if setting.kind == MEASURED:
        seconds = measured
    elif setting.kind == GIVEN:
        seconds = setting.seconds
    elif flops_per_example is None or examples_per_tower is None:
        seconds = None
    else:
        seconds = flops_per_example * examples_per_tower / (setting.peak * setting.efficiency)
    if seconds is not None and speeds:
        seconds /= max(speeds) if fastest else min(speeds)
    return Compute(seconds, source_of(setting, flops_per_example, examples_per_tower, speeds,
                                      fastest), measured, flops_per_example, tuple(speeds))
