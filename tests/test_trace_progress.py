"""The call that traces the compiled loop is logged: before, while it lasts, and after."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from mgloop.runs import tracing_log
from tests import helpers


def _messages(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records]


def _trace_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "mgloop-trace-log"]


def test_the_first_loop_logs_its_trace_and_later_loops_do_not(tmp_path, caplog):
    trainer = helpers.build_trainer(helpers.small_config(str(tmp_path), devices="cpu:2"))
    batches = helpers.batches(4)
    with caplog.at_level(logging.INFO, logger="absl"):
        helpers.run_batches(trainer, batches[:2])
    lines = _messages(caplog)
    before = [line for line in lines if line.startswith("tracing the training step")]
    after = [line for line in lines if line.startswith("traced the training step")]
    num_variables = len(trainer.model.trainable_variables)
    assert before == [f"tracing the training step (2 towers, {num_variables} variables, "
                      "aggregation ps_cpu)..."]
    assert len(after) == 1 and after[0].endswith(" s")
    assert lines.index(before[0]) < lines.index(after[0])
    assert not _trace_threads()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="absl"):
        helpers.run_batches(trainer, batches[2:])  # traced already: nothing logged
    assert not [line for line in _messages(caplog) if "tracing" in line or "traced" in line]


def test_a_long_trace_logs_while_it_lasts_and_its_thread_ends(caplog):
    with caplog.at_level(logging.INFO, logger="absl"):
        with tracing_log.logged_trace("what", every=0.02):
            time.sleep(0.15)
    still = [line for line in _messages(caplog) if line.startswith("still tracing")]
    assert len(still) >= 2
    assert not _trace_threads()


def test_the_thread_ends_when_the_trace_raises(caplog):
    with caplog.at_level(logging.INFO, logger="absl"):
        with pytest.raises(ValueError):
            with tracing_log.logged_trace("what", every=0.02):
                time.sleep(0.05)
                raise ValueError("the trace failed")
    assert not _trace_threads()
    assert not [line for line in _messages(caplog) if line.startswith("traced the")]
