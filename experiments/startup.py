"""What a fresh Python process pays before it can train: imports, timed side by side.

    python -m experiments.startup --rounds=7
    python -m experiments.startup --cases=python,mgloop,tensorflow,keras --baseline=python
    python -m experiments.startup --cases=tensorflow,tensorflow_without_ipython,tensorflow_without_ipython_or_matplotlib,train_entry --baseline=tensorflow --rounds=9
    python -m experiments.startup --cases=run_ring_autograph,run_ring_loop_autograph,run_ring --rounds=5
    python -m experiments.startup --cases=run_qsgd_autograph,run_qsgd_loop_autograph,run_qsgd --rounds=5
    python -m experiments.startup --cases=run_qsgd_gc,run_qsgd --rounds=5

Every process the suite, the sweep and the launcher start pays this. Each case is a
fresh `python -c CODE` (CASES below), run to its end; `--rounds` rounds run every case
once, one at a time, in an order rotated by one each round (experiments/benchlib.py).
Reported: each case's median wall time with its MAD, and its difference from and ratio
to `--baseline` (measured in the same rounds).

By default, `keras` and `keras_without_sklearn`: Keras imports scikit-learn whenever it
is installed (for its scikit-learn wrappers), so `keras` is timed as the machine has it
and with `sklearn` made unimportable (`sys.modules["sklearn"] = None`, as if it were not
installed): the difference is what every such process saves once scikit-learn is no
longer a dependency. `tensorflow_without_ipython` likewise without IPython, which Keras
imports whenever it is installed, only for notebooks, and `..._or_matplotlib` without
matplotlib too, which Keras imports for its image-gallery plots: what an entry point saves
by holding them back while TensorFlow loads (runs/quiet_start.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

from absl import app, flags

from experiments import benchlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

FLAGS = flags.FLAGS
CASES = {
    "python": "pass",  # the interpreter alone
    "keras": "import keras",
    "keras_without_sklearn": "import sys; sys.modules['sklearn'] = None; import keras",
    "tensorflow": "import tensorflow",
    # Keras's notebook-only IPython held back
    "tensorflow_without_ipython": "import sys; sys.modules['IPython'] = None; import tensorflow",
    # and its plotting-only matplotlib too: as an entry point loads it
    # (runs/quiet_start.py `without_display_modules`)
    "tensorflow_without_ipython_or_matplotlib": "import sys; sys.modules['IPython'] = None; "
                                                "sys.modules['matplotlib'] = None; "
                                                "import tensorflow",
    "train_entry": "import mgloop.train",  # the entry point's imports, quiet_start's included
    "mgloop": "import mgloop",  # loads no TensorFlow (mgloop/__init__.py)
    "mgloop_run": "import mgloop; mgloop.run",  # the API, TensorFlow and Keras with it
}
# A first run: 4 logical CPU towers, the mlp, 20 steps in one compiled loop, an eval and a
# checkpoint, traced without AutoGraph (loop.py). `_loop_autograph` converts the loop with
# AutoGraph (a tf.function with AutoGraph on), `_autograph` the loop and the step (each
# function the step calls converted too): the differences are the tracing saved.
RUN = ("import sys, tempfile; import mgloop; mgloop.configure_logical_cpus(4); {patch}"
       "mgloop.run(mgloop.Config(devices='cpu:4', aggregation='{method}', model='mlp', "
       "train_steps=20, steps_per_loop=20, summary_every=0, log_every=0, "
       "logdir=tempfile.mkdtemp()))")
LOOP_CONVERTED = ("import tensorflow as tf; from mgloop.runs import loop; "
                  "loop.Loop.compiled_loop = tf.function("
                  "loop.Loop.compiled_loop.python_function); ")
CONVERTED = LOOP_CONVERTED + "tf.autograph.experimental.do_not_convert = lambda f: f; "
# `_gc`: the collector set for tracing once the modules are imported, as mgloop.train does
# (mgloop/runs/collector.py)
GC_TUNED = ("import mgloop.runs.experiment; from mgloop.runs import collector; "
            "collector.for_tracing(); ")
for _method in ("ring", "qsgd"):
    CASES[f"run_{_method}"] = RUN.format(method=_method, patch="")
    CASES[f"run_{_method}_gc"] = RUN.format(method=_method, patch=GC_TUNED)
    CASES[f"run_{_method}_loop_autograph"] = RUN.format(method=_method, patch=LOOP_CONVERTED)
    CASES[f"run_{_method}_autograph"] = RUN.format(method=_method, patch=CONVERTED)
flags.DEFINE_list("cases", ["keras", "keras_without_sklearn"], f"of: {', '.join(CASES)}")
flags.DEFINE_string("baseline", None, "the case of the differences and ratios (default: "
                    "the last of --cases)")
flags.DEFINE_integer("rounds", 7, "rounds side by side; each case once per round")
flags.DEFINE_string("json_out", None, "write the rows (with command, settings, machine) here")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    unknown = [case for case in FLAGS.cases if case not in CASES]
    baseline = FLAGS.baseline or FLAGS.cases[-1]
    if unknown or baseline not in FLAGS.cases:
        raise app.UsageError(f"--cases and --baseline name cases of: {', '.join(CASES)}; the "
                             "baseline among --cases")

    def process(code):
        return lambda: subprocess.run([sys.executable, "-c", code], check=True,
                                      capture_output=True, cwd=ROOT)
    runs = {case: benchlib.timer(process(CASES[case])) for case in FLAGS.cases}
    rows = benchlib.summarize(benchlib.rounds(runs, FLAGS.rounds))
    benchlib.add_ratio(rows, "median", baseline)
    base = next(row for row in rows if row["case"] == baseline)
    for row in rows:
        row.update(code=CASES[row["case"]], difference_s=row["median"] - base["median"])
    benchlib.publish(
        f"fresh processes, medians over {FLAGS.rounds} rounds side by side; baseline "
        f"{baseline}", rows,
        [("case", "case", "s"), ("code", "python -c", "s"), ("median", "median s", ".2f"),
         ("mad", "± MAD s", ".2f"), ("difference_s", f"− {baseline} (s)", "+.2f"),
         ("ratio", f"÷ {baseline}", ".2f")], FLAGS.json_out,
        {"cases": FLAGS.cases, "baseline": baseline, "rounds": FLAGS.rounds})


if __name__ == "__main__":
    app.run(main)
