"""Test-process set-up: 4 logical CPU devices, configured once before TensorFlow starts."""

import gc
import os
import re

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

from mgloop.runs import collector, quiet_start  # noqa: E402

with quiet_start.without_display_modules():  # as the entry points load TensorFlow
    from mgloop.cluster import devices  # noqa: E402

MAX_TOWERS = 4
devices.configure_logical_cpus(MAX_TOWERS)


def pytest_collection_finish(session):
    """Once every test module (TensorFlow, Keras, mgloop) is imported: the collector set for
    tracing (mgloop/runs/collector.py). What a test checks of the collector
    (test_long_run_memory, test_sweep) collects explicitly."""
    collector.for_tracing()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Once every fixture is torn down: one full collection (what the tests left is freed
    here, and an exception raised by a finalizer is reported as pytest would), then what
    survives frozen, so pytest's own five collections at its cleanup and the interpreter's
    at exit walk none of it (tracing leaves millions of objects alive in a test process:
    those five took 8.0 s of CPU after tests/test_contract.py and tests/test_aggregation.py
    in one process, 2.1 s with this)."""
    gc.collect()
    gc.freeze()


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


QUICK = os.path.join(os.path.dirname(__file__), "quick.txt")


def quick_entries() -> list[str]:
    """tests/quick.txt's entries: node ids of modules, functions or parametrized tests."""
    with open(QUICK) as handle:
        return [line.strip() for line in handle if line.strip() and not line.startswith("#")]


def is_quick(nodeid: str, entries) -> str | None:
    """The entry naming the test `nodeid` (xdist's "@group" suffix, which holds no bracket,
    left out; a parameter may hold "@"), if any: the parametrized test, the function
    (with any parameters) or the module."""
    base = re.sub(r"@[^\[\]]*$", "", nodeid)
    for candidate in (base, base.partition("[")[0], base.partition("::")[0]):
        if candidate in entries:
            return candidate
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the quick tier (tests/quick.txt): "
                                       "python -m pytest -m quick")


def pytest_collection_modifyitems(config, items):
    entries = set(quick_entries())  # (tests/test_quick_tier.py: every entry names a test)
    for item in items:
        if is_quick(item.nodeid, entries) is not None:
            item.add_marker(pytest.mark.quick)
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))  # stable: order kept
