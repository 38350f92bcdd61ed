"""Where the time of a traced loop goes: op time per op type, from a tf.profiler trace.

    python experiments/trace_summary.py <trace dir> [--top=15]

Reads the `*.xplane.pb` files that `tf.profiler.experimental.start/stop` wrote
(the same trace TensorBoard's Profile tab shows, with the
tensorboard-plugin-profile package: `pip install -e '.[profile]'`). Sums the
durations of the host's TensorFlow op events (the "TensorFlow Ops" lines of
the /host:CPU plane) by op type (the event name's last component before the
":Type" suffix), and reports each type's total milliseconds, event count and
share of the summed op time. The runtime's own spans are listed in
[brackets]: `[ExecutorState::Process]` is the executor running a batch of
ready ops (it encloses the kernels it runs), `[...ProcessAsync::Start]` and
`[...::Done]` are asynchronous ops (the _Recv of a cross-device edge), so op
events and spans overlap. Ops run concurrently on the inter-op threads, so
shares are of busy time, not of wall time.
"""

from __future__ import annotations

import collections
import glob
import os
import sys

from absl import app, flags

_FLAGS = flags.FLAGS
flags.DEFINE_integer("top", 15, "op types to list")
flags.DEFINE_integer("steps", 1, "training steps in the traced loop (for per-step figures)")


def op_times(trace_dir: str) -> tuple[dict[str, float], dict[str, int], float]:
    """(milliseconds per op type, events per op type, wall milliseconds spanned)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise SystemExit(f"no *.xplane.pb under {trace_dir}")
    totals, counts = collections.Counter(), collections.Counter()
    first, last = None, None
    for path in paths:
        space = xplane_pb2.XSpace()
        with open(path, "rb") as handle:
            space.ParseFromString(handle.read())
        for plane in space.planes:
            if not plane.name.startswith("/host:CPU"):
                continue
            names = {key: meta.name for key, meta in plane.event_metadata.items()}
            for line in plane.lines:
                if line.name == "python" or line.name.startswith("tf_data"):
                    continue  # the Python caller, the input pipeline
                for event in line.events:
                    name = names.get(event.metadata_id, "?")
                    if "::" in name:  # the runtime's own spans, e.g. ExecutorState::Process
                        op_type = f"[{name}]"
                    elif ":" in name:  # an op: "<op name>:<op type>"
                        op_type = name.rsplit(":", 1)[1]
                    else:
                        continue  # thread-pool bookkeeping
                    totals[op_type] += event.duration_ps / 1e9
                    counts[op_type] += 1
                    start = line.timestamp_ns + event.offset_ps / 1e3
                    end = start + event.duration_ps / 1e3
                    first = start if first is None else min(first, start)
                    last = end if last is None else max(last, end)
    span = (last - first) / 1e6 if first is not None else 0.0
    return dict(totals), dict(counts), span


def main(argv):
    if len(argv) != 2:
        raise app.UsageError("usage: trace_summary.py <trace dir>")
    totals, counts, span = op_times(argv[1])
    busy = sum(ms for op_type, ms in totals.items() if not op_type.startswith("["))
    steps = _FLAGS.steps
    events = sum(n for op_type, n in counts.items() if not op_type.startswith("["))
    print(f"{argv[1]}: per step {events / steps:.0f} op events, {busy / steps:.3f} ms of op time "
          f"summed over threads, {span / steps:.3f} ms from first op to last "
          f"({busy / events * 1e3:.1f} us per op event)")
    print("| op type | ms per step | events per step | share of op time |\n|---|---|---|---|")
    print("(runtime spans in [brackets] enclose op time; their share is relative to it)")
    for op_type, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:_FLAGS.top]:
        print(f"| {op_type} | {ms / steps:.3f} | {counts[op_type] / steps:.0f} | {ms / busy:.1%} |")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    app.run(main)
