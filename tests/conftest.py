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


# In pytest's (alphabetical) order the sweep modules' long tests (20 to 60 s each) came
# last: one test process ran them alone while the other had nothing left. Handed out
# first, they overlap the other process's work; what comes last is short.
FIRST = ("tests/test_sweep.py", "tests/test_sweep_stop.py", "tests/test_sweep_tune.py",
         "tests/test_elastic.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))  # stable: order kept
