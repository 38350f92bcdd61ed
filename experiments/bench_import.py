"""What a fresh Python process pays to import Keras, with scikit-learn installed and without.

    python experiments/bench_import.py --repeats=7

Keras imports scikit-learn whenever it is installed (for its scikit-learn wrappers), and
every process the suite, the sweep and the launcher start imports Keras. Each repeat
starts `python -c "import keras"` twice, one after the other (order alternating): once as
the machine has it, once with `sklearn` made unimportable (`sys.modules["sklearn"] =
None`, as if it were not installed). Reported: the median wall time of each, and their
difference: what every such process saves once scikit-learn is no longer a dependency.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_integer("repeats", 7, "fresh processes of each kind")

WITH = "import keras"
WITHOUT = "import sys; sys.modules['sklearn'] = None; import keras"


def seconds(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - start


def main(argv):
    del argv
    times = {WITH: [], WITHOUT: []}
    for r in range(FLAGS.repeats):
        for code in ((WITH, WITHOUT) if r % 2 == 0 else (WITHOUT, WITH)):
            times[code].append(seconds(code))
    with_sklearn, without = (statistics.median(times[c]) for c in (WITH, WITHOUT))
    print(f"import keras, scikit-learn installed:  {with_sklearn:.2f} s (median of "
          f"{FLAGS.repeats})")
    print(f"import keras, scikit-learn not there: {without:.2f} s")
    print(f"saved per process: {with_sklearn - without:.2f} s "
          f"({with_sklearn / without:.2f}x)")


if __name__ == "__main__":
    app.run(main)
