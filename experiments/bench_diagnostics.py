"""Cost of the scalar diagnostics: every one on against every one off, side by side.

    python experiments/bench_diagnostics.py --model=mlp --devices=cpu:2

Two trainers in this process, identical but for `--diagnostics` (per-tower loss
and gradient norm, gradient cosine and norm ratio inside the compiled step). A
timed repeat is one compiled loop of `--summary_every` steps, as `fit` runs it
between summaries; for the `on` trainer it also includes what happens at each
summary: replica divergence, the memory scalars and the loss scale (the
Monitor's `scalars`). Repeats are interleaved (off, on, off, on, ...).
Reported: median seconds per step over the repeats, and on / off.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

_FLAGS = flags.FLAGS
flags.DEFINE_string("model", "mlp", "model to train")
flags.DEFINE_string("devices", "cpu:2", "tower devices")
flags.DEFINE_string("aggregation", "reduce_broadcast", "aggregation")
flags.DEFINE_integer("global_batch_size", 128, "global batch")
flags.DEFINE_integer("summary_every", 20, "steps per timed loop (one summary window)")
flags.DEFINE_integer("warmup", 3, "untimed loops per system before timing")
flags.DEFINE_integer("repeats", 25, "timed loops per system, interleaved")


def main(argv):
    del argv
    from mgloop import devices
    devices.configure_logical_cpus(int(_FLAGS.devices.split(":")[1]))
    from mgloop import monitor
    systems = {}
    for name, on in (("off", False), ("on", True)):
        trainer, iterator = benchlib.build(_FLAGS.model, _FLAGS.global_batch_size,
                                           devices=_FLAGS.devices,
                                           aggregation=_FLAGS.aggregation, diagnostics=on)
        watch = monitor.Monitor(trainer, None, None, None, divergence=on) if on else None
        systems[name] = (trainer, iterator, watch)
    steps = _FLAGS.summary_every

    def window(trainer, iterator, watch):
        began = time.perf_counter()
        trainer.train_loop(iterator, steps)
        if watch is not None:
            watch.scalars(steps)
        return (time.perf_counter() - began) / steps

    for trainer, iterator, watch in systems.values():
        for _ in range(_FLAGS.warmup):
            window(trainer, iterator, watch)
    times = {name: [] for name in systems}
    for _ in range(_FLAGS.repeats):
        for name, system in systems.items():
            times[name].append(window(*system))
    off, _ = benchlib.median_and_mad(times["off"])
    rows = []
    for name in systems:
        median, mad = benchlib.median_and_mad(times[name])
        rows.append(dict(name=name, ms=1e3 * median, mad=1e3 * mad, ratio=median / off))
    print(" ".join(sys.argv))
    print(benchlib.markdown(rows, [("name", "diagnostics", "s"), ("ms", "ms/step", ".3f"),
                                   ("mad", "MAD ms", ".3f"), ("ratio", "on / off", ".3f")]))


if __name__ == "__main__":
    app.run(main)
