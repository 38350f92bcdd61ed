"""Test-process set-up: 4 logical CPU devices, configured once before TensorFlow starts."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

from mgloop.cluster import devices  # noqa: E402

MAX_TOWERS = 4
devices.configure_logical_cpus(MAX_TOWERS)


@pytest.fixture
def logdir(tmp_path):
    return str(tmp_path / "run")


@pytest.fixture
def gpus(monkeypatch):
    """Pretends the machine has the given number of GPUs (0 on every machine, for error paths)."""
    def pretend(count):
        monkeypatch.setattr(devices, "_visible_gpus", lambda: count)
    return pretend


# The longest tests first (longest-processing-time-first scheduling): these modules start
# processes (CLI runs, worker jobs, a TensorBoard server) and hold the suite's longest
# tests (15-60 s each). Handed out last, one of them kept one test process busy while the
# other had nothing left (wall 746 s at 86% of both cores, against 693 s at 95% for the
# same CPU seconds). A stable sort: the order within each part is pytest's.
FIRST = ("test_sweep.py", "test_long_run_memory.py", "test_plugin.py", "test_bench.py",
         "test_preemption.py", "test_cli.py", "test_experiments.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in FIRST)
