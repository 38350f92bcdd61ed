"""Imported by every Python process started with this folder on PYTHONPATH (see
experiments/suite_cpu.py): at exit, one JSON line with the process's own CPU seconds
(user + sys, getrusage) and the test that was running when it started (the
PYTEST_CURRENT_TEST it inherited; empty for the test processes themselves). A process
killed by a signal writes nothing."""

import atexit
import json
import os
import resource
import sys


def _record():
    out = os.environ.get("SUITE_CPU_PROCESSES")
    if not out:
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    line = json.dumps({"pid": os.getpid(), "argv": sys.argv[:4],
                       "cpu": usage.ru_utime + usage.ru_stime,
                       "test": os.environ.get("PYTEST_CURRENT_TEST", "")})
    try:
        with open(out, "a") as handle:
            handle.write(line + "\n")
    except OSError:
        pass


atexit.register(_record)
