"""A pytest plugin (-p cpu_per_test): per test, the CPU seconds of its own process
(time.process_time: every thread, setup and teardown included), its wall seconds and
when it started, one JSON line each in $SUITE_CPU_TESTS."""

import json
import os
import time

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, began = time.process_time(), time.time()
    yield
    with open(os.environ["SUITE_CPU_TESTS"], "a") as handle:
        handle.write(json.dumps({"id": item.nodeid, "cpu": time.process_time() - cpu,
                                 "wall": time.time() - began, "start": began,
                                 "pid": os.getpid()}) + "\n")
