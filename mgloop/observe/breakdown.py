"""Step-time breakdown of one profiled step: input, compute, aggregation, apply.

The phases of a step run inside one compiled function, interleaved across
devices, where Python cannot time them. So every `--breakdown_every` steps
the outer loop runs one step alone under `tf.profiler` (into a temp folder,
removed after), and this module reads the trace (the XSpace protobuf the
profiler writes) and attributes every executed TensorFlow op to the phase
whose name scope it was built in (`PHASES`, phases.py, the scopes of step/training_step.py):
`input` = taking the batch and staging a later one (staging.py); `compute` =
reading the variables, forward, loss and gradients on the towers;
`aggregation` = the gradient exchange and the averaging of non-trainable
state; `apply` = the optimizer updates. For each phase it reports the wall
time during which at least one of its ops ran on any device (the union of
their intervals):

    breakdown/input, breakdown/compute, breakdown/aggregation, breakdown/apply
    breakdown/step    from the first op's start to the last op's end, over the
                      ops of the step (its phases, and the rest of its scope
                      `STEP_SCOPE`: not the priming of staging areas, say)
    breakdown/other   step minus the union of the phases: time in which no
                      phase op ran (scheduling, the step's bookkeeping ops
                      such as the global step and the loss sums)

Phases overlap (the exchange of one variable runs while another's gradient is
computed; a later batch is staged during the compute), so their sum with
`other` can exceed `step`.
The profiler adds its own cost per op: compare phases within a step and
between runs, not with the unprofiled `step_time`. How long the towers wait for
input is measured on every step without the profiler (`input_wait`, loop.py):
`breakdown/input` is the input ops' busy time, overlapped or not; the iterator's get-next
is an asynchronous op recorded with no duration, so with a small batch it can read 0.

CPU ops appear in the trace as events named `<op name>:<op type>`; GPU
kernels as events carrying a `tf_op` stat of that form (read the same way;
not exercised on these GPU-less machines beyond a synthetic trace in the tests).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
from typing import Callable, Iterable

import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from mgloop.phases import PHASES, STEP_SCOPE  # the step's name scopes (no protobufs there)
_OP_EVENT = re.compile(r"([^\s:]+):(\w+)")  # "<op name>:<op type>"
_UNIQUE_SUFFIX = re.compile(r"_\d+$")
# Op-level host events (level 2), no Python tracing, device kernels where there are GPUs.
PROFILER_OPTIONS = tf.profiler.experimental.ProfilerOptions(
    host_tracer_level=2, python_tracer_level=0, device_tracer_level=1)


class PhaseProfile:
    """One profiler session into a temp folder: `start()`, run steps, `stop()` -> phase_seconds."""

    def __init__(self, phases: tuple[str, ...] = PHASES):
        self.phases = phases
        self.folder: str | None = None

    def start(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="mgloop-breakdown-")
        tf.profiler.experimental.start(self.folder, options=PROFILER_OPTIONS)

    def stop(self) -> dict[str, float]:
        """Stops the profiler, reads the trace, removes the folder; `phase_seconds` of the trace."""
        try:
            tf.profiler.experimental.stop()
            return phase_seconds(read_trace(self.folder), self.phases)
        finally:
            self.discard()

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = None


def profile_phases(run: Callable[[], object], phases: tuple[str, ...] = PHASES
                   ) -> dict[str, float]:
    """Runs `run()` (e.g. one `Trainer.train_loop` of one step) under the profiler and
    returns `phase_seconds` of its trace."""
    session = PhaseProfile(phases)
    session.start()
    try:
        run()
    except BaseException:
        tf.profiler.experimental.stop()
        session.discard()
        raise
    return session.stop()


def read_trace(folder: str) -> xplane_pb2.XSpace:
    """The XSpace the profiler wrote under `folder` (`plugins/profile/<run>/<host>.xplane.pb`)."""
    paths = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no profiler trace (*.xplane.pb) under {folder}")
    space = xplane_pb2.XSpace()
    with open(max(paths, key=os.path.getmtime), "rb") as trace:
        space.ParseFromString(trace.read())
    return space


def phase_of(op_name: str, phases: tuple[str, ...] = PHASES) -> str | None:
    """The innermost name-scope segment of `op_name` that is a phase, e.g.
    "while/body/_1/compute/tower_0/MatMul" -> "compute", ".../compute/aggregation/add" ->
    "aggregation"; None outside the phases. A scope entered again in the same graph is
    made unique by TensorFlow ("compute_1")."""
    for segment in reversed(op_name.split("/")):
        segment = _UNIQUE_SUFFIX.sub("", segment)
        if segment in phases:
            return segment
    return None


def op_intervals(space: xplane_pb2.XSpace) -> Iterable[tuple[str, int, int]]:
    """(op name, start ps, end ps) of every TensorFlow op execution in the trace."""
    for plane in space.planes:
        tf_op_stat = next((i for i, m in plane.stat_metadata.items() if m.name == "tf_op"), None)
        for line in plane.lines:
            base = line.timestamp_ns * 1000
            for event in line.events:
                name = _op_name(plane, event, tf_op_stat)
                if name is not None:
                    start = base + event.offset_ps
                    yield name, start, start + event.duration_ps


def phase_seconds(space: xplane_pb2.XSpace, phases: tuple[str, ...] = PHASES
                  ) -> dict[str, float]:
    """Busy seconds per phase, the step's span and the time outside every phase (see top)."""
    intervals = {phase: [] for phase in phases}
    step_ops = []
    for name, start, end in op_intervals(space):
        phase = phase_of(name, phases)
        if phase is not None:
            intervals[phase].append((start, end))
        if phase is not None or phase_of(name, (STEP_SCOPE,)):
            step_ops.append((start, end))
    everything = [i for phase in phases for i in intervals[phase]]
    if not everything:
        raise ValueError("the profiled step has no op in the phases "
                         f"{', '.join(phases)}: nothing to break down")
    span = max(end for _, end in step_ops) - min(start for start, _ in step_ops)
    out = {phase: _union_length(intervals[phase]) * 1e-12 for phase in phases}
    out["step"] = span * 1e-12
    out["other"] = (span - _union_length(everything)) * 1e-12
    return out


def _op_name(plane, event, tf_op_stat) -> str | None:
    """The op name of a trace event, or None if the event is not an op execution."""
    if tf_op_stat is not None:
        for stat in event.stats:
            if stat.metadata_id == tf_op_stat:
                value = stat.str_value or plane.stat_metadata[stat.ref_value].name
                return value.rsplit(":", 1)[0]
    name = plane.event_metadata[event.metadata_id].name
    match = _OP_EVENT.fullmatch(name)  # not runtime events (ExecutorState::Process, ...)
    return match.group(1) if match else None


def _union_length(intervals: list[tuple[int, int]]) -> int:
    """Total length covered by the union of [start, end) intervals."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total
