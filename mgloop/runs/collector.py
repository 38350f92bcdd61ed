"""Python's garbage collector set for a process that traces TensorFlow functions.

Tracing a step allocates millions of short-lived Python objects, so the collector's young
generation (collected every 700 net allocations by default) runs thousands of times per
trace, and every older pass walks the objects of the imported modules (TensorFlow, Keras:
about a million) again. `for_tracing()`, called once the modules are imported:

- `gc.freeze()`: the objects alive now (the modules') move to the permanent generation,
  which no collection walks (they are never garbage: the modules live as long as the
  process);
- `gc.set_threshold(20_000, 20, 20)`: the young generation collected every 20,000 net
  allocations (a cycle of garbage lives a little longer; no object is kept that would
  otherwise be freed, and reference counting frees everything without a cycle at once).

Measured: a fresh process's first qsgd run 8.07 ± 0.06 s against 9.68 ± 0.30 s (0.83;
`python -m experiments.startup --cases=run_qsgd_gc,run_qsgd --rounds=5`, medians of 5
rounds side by side); four test modules run alternately in one process, 75.0 and 81.2 s of
CPU against 84.6 and 88.5 s (tests/conftest.py). Called by the entry points that own their
process (`mgloop.train`, a sweep's cell worker) and the test processes; a user's script
that imports mgloop keeps its own collector settings.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000


def for_tracing() -> None:
    """Freezes what is alive now out of the collector's passes and makes its young passes
    rarer (the module docstring)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, 20, 20)
