"""Where the test suite's CPU goes: per test, per module and per process, in one run.

    python -m experiments.suite_cpu [--output_dir=DIR] [-- PYTEST ARGS]

Runs `python -m pytest` (its own flags from setup.cfg: two test processes) under
/usr/bin/time-like accounting, with experiments/suite_cpu/ on PYTHONPATH, so that:

- each test records its process's CPU seconds (`cpu_per_test.py`, a pytest plugin);
- every Python process the suite starts (workers of `mgloop.launch`, `mgloop.train`
  runs, TensorBoard servers, benchmark workers) records its own CPU seconds at exit,
  with the test that started it (`sitecustomize.py`), at its atexit: what it spends
  tearing down after that, and all of a process killed by a signal (the multi-worker
  tests kill some on purpose), is not recorded; the gap to the whole run's CPU is
  reported.

Then prints the whole run's wall and CPU seconds (of every process it started, as
getrusage's children), the split between the test processes and the processes they
started, the modules by CPU (in-process + started by their tests), the longest tests
and the last minute of each test process (what ran alone at the end). Not a timing
benchmark: the machine must be otherwise idle for the wall time to mean anything.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run(pytest_args: list[str], folder: str) -> dict:
    processes, tests = os.path.join(folder, "processes.jsonl"), os.path.join(folder, "tests.jsonl")
    for path in (processes, tests):  # a reused --output_dir: this run's lines alone
        if os.path.exists(path):
            os.remove(path)
    env = dict(os.environ, SUITE_CPU_PROCESSES=processes, SUITE_CPU_TESTS=tests,
               PYTHONPATH=os.pathsep.join(
                   [os.path.join(HERE, "suite_cpu"), ROOT] +
                   [p for p in [os.environ.get("PYTHONPATH")] if p]))
    began = time.time()
    code = subprocess.call([sys.executable, "-m", "pytest", "-p", "cpu_per_test", *pytest_args],
                           cwd=ROOT, env=env)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"exit_code": code, "wall": time.time() - began,
            "cpu": usage.ru_utime + usage.ru_stime,
            "processes": _lines(processes), "tests": _lines(tests)}


def _lines(path: str) -> list[dict]:
    """The JSON lines at `path` (none if no process or test wrote one)."""
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle]


def report(result: dict) -> str:
    tests, processes = result["tests"], result["processes"]
    started = [p for p in processes if p["test"]]  # by a test (the test processes: no test)
    in_tests = sum(t["cpu"] for t in tests)
    by_module, by_test = collections.Counter(), collections.Counter()
    for t in tests:
        by_module[t["id"].split("::")[0]] += t["cpu"]
        by_test[t["id"]] += t["cpu"]
    for p in started:
        test = p["test"].rsplit(" ", 1)[0]  # "path::name (call)"
        by_module[test.split("::")[0]] += p["cpu"]
        by_test[test] += p["cpu"]
    own = sum(p["cpu"] for p in processes if not p["test"])
    lines = [f"exit code {result['exit_code']}; wall {result['wall']:.0f} s; CPU of every "
             f"process {result['cpu']:.0f} s",
             f"test processes {own:.0f} s (in tests {in_tests:.0f} s); {len(started)} processes "
             f"started by tests {sum(p['cpu'] for p in started):.0f} s; not recorded (what "
             f"processes spend after their atexit, tearing down, and those killed by a "
             f"signal) {result['cpu'] - own - sum(p['cpu'] for p in started):.0f} s",
             "", "| module | CPU s |", "|---|---|"]
    lines += [f"| {m} | {s:.1f} |" for m, s in by_module.most_common(15)]
    lines += ["", "| test | CPU s |", "|---|---|"]
    lines += [f"| {t} | {s:.1f} |" for t, s in by_test.most_common(15)]
    if tests:
        start = min(t["start"] for t in tests)
        for pid in sorted({t["pid"] for t in tests}):
            mine = sorted((t for t in tests if t["pid"] == pid), key=lambda t: t["start"])
            end = max(t["start"] + t["wall"] for t in mine) - start
            last = [t for t in mine if t["start"] - start > end - 60 and t["wall"] > 1]
            lines.append(f"\ntest process {pid}: {len(mine)} tests, ends at {end:.0f} s; "
                         "its last minute: " + "; ".join(
                             f"{t['id'].split('::')[-1][:60]} {t['wall']:.0f} s" for t in last))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", help="keeps processes.jsonl, tests.jsonl, report.md")
    args, pytest_args = parser.parse_known_args()
    pytest_args = [a for a in pytest_args if a != "--"]
    folder = args.output_dir or tempfile.mkdtemp(prefix="suite-cpu-")
    os.makedirs(folder, exist_ok=True)
    text = report(run(pytest_args, folder))
    with open(os.path.join(folder, "report.md"), "w") as handle:
        handle.write(text + "\n")
    print(f"command: python {shlex.join(sys.argv)}\n{text}\noutputs in {folder}")


if __name__ == "__main__":
    main()
