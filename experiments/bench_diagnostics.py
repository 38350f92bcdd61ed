"""Cost of the scalar diagnostics: every one on against every one off, side by side.

    python experiments/bench_diagnostics.py --model=mlp --devices=cpu:2

Four trainers in this process, identical but for `--diagnostics` (per-tower loss
and gradient norm, gradient cosine and norm ratio, replica divergence, computed
in the compiled loop on the last step of each summary window), built in the
order off, on, on, off: on a small model the build order alone moves the step
time by several percent in one process, so each setting has a trainer at both
ends. A timed repeat is one compiled loop of `--summary_every` steps, as `fit`
runs it between summaries; for an `on` trainer it also includes what the
Monitor does at each summary (`scalars`: memory, loss scale). Each round runs
every trainer once, the order rotating by one each round. Reported: median
seconds per step per trainer; on / off as the median over rounds of
(on_a + on_b) / (off_a + off_b), with its MAD and standard error; and two A/A
controls (off_b / off_a, on_b / on_a) that show the noise floor of this
machine at that moment.

Then the step-time breakdown (--breakdown_every): one step alone under the
profiler (breakdown.profile_phases) against one step alone without it, on the
`off` trainer, interleaved; the difference is what one breakdown costs, and
divided by --breakdown_every, what it costs per step.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

_FLAGS = flags.FLAGS
flags.DEFINE_string("model", "mlp", "model to train")
flags.DEFINE_string("devices", "cpu:2", "tower devices")
flags.DEFINE_string("aggregation", "reduce_broadcast", "aggregation")
flags.DEFINE_integer("global_batch_size", 128, "global batch")
flags.DEFINE_integer("summary_every", 20, "steps per timed loop (one summary window)")
flags.DEFINE_integer("warmup", 3, "untimed loops per system before timing")
flags.DEFINE_integer("repeats", 60, "timed loops per trainer, interleaved (rotating order)")
flags.DEFINE_integer("breakdown_every", 1000, "steps between profiled steps, to state the "
                     "breakdown's cost per step")
flags.DEFINE_integer("breakdown_repeats", 7, "profiled and plain single steps, interleaved")


def main(argv):
    del argv
    from mgloop import devices
    devices.configure_logical_cpus(int(_FLAGS.devices.split(":")[1]))
    from mgloop import breakdown, monitor
    # Built in the order off, on, on, off: the trainers' build order moves the step
    # time of a small model by several percent in one process (an A/A effect), so
    # each setting has one trainer at each end and the two of a setting are summed.
    systems = {}
    for name, on in (("off_a", False), ("on_a", True), ("on_b", True), ("off_b", False)):
        trainer, iterator = benchlib.build(_FLAGS.model, _FLAGS.global_batch_size,
                                           devices=_FLAGS.devices,
                                           aggregation=_FLAGS.aggregation, diagnostics=on)
        watch = monitor.Monitor(trainer, None, None, None) if on else None
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
    names = list(systems)
    for repeat in range(_FLAGS.repeats):  # every order position in turn
        for name in names[repeat % 4:] + names[:repeat % 4]:
            times[name].append(window(*systems[name]))
    t = {name: np.array(values) for name, values in times.items()}
    per_round = {"on / off": (t["on_a"] + t["on_b"]) / (t["off_a"] + t["off_b"]),
                 "A/A control: off_b / off_a": t["off_b"] / t["off_a"],
                 "A/A control: on_b / on_a": t["on_b"] / t["on_a"]}
    rows = []
    for name in names:
        median, mad = benchlib.median_and_mad(times[name])
        rows.append(dict(name=name, ms=1e3 * median, mad=1e3 * mad))
    print(" ".join(sys.argv))
    print(benchlib.markdown(rows, [("name", "trainer", "s"), ("ms", "ms/step", ".3f"),
                                   ("mad", "MAD ms", ".3f")]))
    ratios = []
    for name, values in per_round.items():
        median, mad = benchlib.median_and_mad(list(values))
        ratios.append(dict(name=name, ratio=median, mad=mad,
                           se=1.2533 * 1.4826 * mad / np.sqrt(len(values))))
    print(benchlib.markdown(ratios, [("name", "ratio (median over rounds)", "s"),
                                     ("ratio", "value", ".3f"), ("mad", "MAD", ".3f"),
                                     ("se", "std. error of the median", ".3f")]))

    trainer, iterator, _ = systems["off_a"]
    single = {"plain": [], "profiled": []}
    phases = []

    def one_step():
        trainer.train_loop(iterator, 1)

    for _ in range(_FLAGS.breakdown_repeats):
        began = time.perf_counter()
        one_step()
        single["plain"].append(time.perf_counter() - began)
        began = time.perf_counter()
        phases.append(breakdown.profile_phases(one_step))
        single["profiled"].append(time.perf_counter() - began)
    plain, _ = benchlib.median_and_mad(single["plain"])
    profiled, _ = benchlib.median_and_mad(single["profiled"])
    cost = profiled - plain
    print(f"\none step alone: {1e3 * plain:.2f} ms plain, {1e3 * profiled:.2f} ms profiled and "
          f"read (median of {_FLAGS.breakdown_repeats}); a breakdown costs {1e3 * cost:.1f} ms, "
          f"at --breakdown_every={_FLAGS.breakdown_every} {1e3 * cost / _FLAGS.breakdown_every:.3f}"
          f" ms/step = {cost / _FLAGS.breakdown_every / np.median(t['off_a']):.3f} of the off "
          "step")
    print("profiled phases (ms, median): " + "  ".join(
        f"{name} {1e3 * float(np.median([p[name] for p in phases])):.3f}" for name in phases[0]))


if __name__ == "__main__":
    app.run(main)
