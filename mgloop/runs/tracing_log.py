"""Log lines around the call that traces the compiled loop, so a long trace is not silent.

Tracing the training step (building its graph in Python, then TensorFlow's graph passes)
can take minutes for a method whose graph grows with towers x variables x chunks, and
nothing else is logged meanwhile. `logged_trace` logs one line before that call, one
every `every` seconds while it lasts (from a thread of its own, stopped and joined when
the call returns or raises), and one with its duration after it:

    tracing the training step (4 towers, 12 variables, aggregation sparseloco)...
    still tracing the training step: 30 s so far
    traced the training step and ran it once in 41.2 s

The duration includes the first step's run (the call that traces also runs it), as
summary.json's `traced_step_seconds` does.
"""

from __future__ import annotations

import contextlib
import threading
import time

from absl import logging

EVERY = 30.0  # seconds between the lines while a trace lasts


@contextlib.contextmanager
def logged_trace(what: str, every: float = EVERY):
    """Around the call that traces: a line before (`what` says what is traced), every
    `every` seconds while it runs, and after it; the thread never outlives the call."""
    logging.info("tracing the training step (%s)...", what)
    began = time.perf_counter()
    stop = threading.Event()

    def remind():
        while not stop.wait(every):
            logging.info("still tracing the training step: %.0f s so far",
                         time.perf_counter() - began)

    thread = threading.Thread(target=remind, name="mgloop-trace-log", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    logging.info("traced the training step and ran it once in %.1f s",
                 time.perf_counter() - began)
