"""Stopping a sweep (`python -m mgloop.sweep`) by SIGINT or SIGTERM, and resuming it
(mgloop/runs/sweep/runner.py, processes.py, kept_evals.py); bad flag values refused."""

import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

from mgloop.runs import quiet_start
from mgloop.runs.sweep import plan as plan_lib
from mgloop.runs.sweep import report
from mgloop.runs.sweep import runner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 4 cells of 20 steps, a loop boundary every 2 steps, an eval every 10, one worker process
# for all 4; op determinism, so the records compare bit for bit
STEPS = 20
SETTINGS = ("model=mlp", "dataset=synthetic", "devices=cpu:2", "global_batch_size=32",
            f"train_steps={STEPS}", "steps_per_loop=2", "checkpoint_every=0",
            "deterministic=true")
VARY = "learning_rate=0.05,0.1"
SEEDS = 2
EVALS = 2
TENSORFLOW_START_UP = re.compile(  # the lines quiet_start.py keeps off stderr
    r"absl::InitializeLog|port\.cc|cudart_stub\.cc|cpu_feature_guard|cuInit")
ABOUT_THE_STOP = re.compile(r"stop|signal|SIGINT|SIGTERM|interrupt|traceback|received", re.I)


def _plan(output_dir) -> plan_lib.Plan:
    return plan_lib.Plan(vary=(VARY,), set=SETTINGS, seeds=tuple(range(SEEDS)),
                         output_dir=str(output_dir), evals=EVALS)


def _command(output_dir) -> list[str]:
    return [sys.executable, "-m", "mgloop.sweep", f"--output_dir={output_dir}",
            f"--seeds={SEEDS}", f"--vary={VARY}", f"--evals={EVALS}",
            "--cells_per_process=4", *[f"--set={item}" for item in SETTINGS]]


def _exact(records) -> dict:
    """What a record holds that does not depend on timing: the curve's steps, eval values and
    bytes, the final eval, the traffic (the modelled seconds use the measured compute)."""
    return {r["cell"]: (r["final_step"], r["eval"], r["traffic"],
                        [{k: v for k, v in point.items() if k != "seconds"}
                         for point in r["curve"]]) for r in records}


def _quiet_environment() -> dict:
    """This environment without TF_CPP_MIN_LOG_LEVEL (conftest.py sets it), so the command
    line is as quiet as on a user's terminal (quiet_start.py)."""
    return {k: v for k, v in os.environ.items() if k != quiet_start.LEVEL_VARIABLE}


def _descendants(pid: int) -> set[int]:
    """Every process under `pid` (from /proc's parent links)."""
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as handle:
                    parents[int(name)] = int(handle.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found |= frontier
    return found


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _stop_at_random(out, signum: int, max_delay: float) -> re.Match:
    """Runs the sweep's command, sends `signum` at a random moment (drawn with a logged
    seed) up to `max_delay` s after its worker began a cell, and checks how it ended: exit
    code 128 + the signal number; exactly one line about the stop, the last on stderr (no
    traceback, no other line naming a signal or a stop), no TensorFlow start-up line; its
    worker process gone when it has exited, and every process under it (multiprocessing's
    resource tracker too, which leaves when its pipe closes) within 2 s (/proc); no lock; the
    checkpoint of the step at which the line says a cell stopped. Returns the line's match
    (done cells, stopped cell, its step)."""
    process = subprocess.Popen(_command(out), cwd=REPO, env=_quiet_environment(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    errors: list[str] = []
    reader = threading.Thread(target=lambda: errors.extend(process.stderr), daemon=True)
    reader.start()
    seed = random.SystemRandom().randrange(2**32)  # the runs seed `random` (keras)
    delay = random.Random(seed).uniform(0.0, max_delay)
    name = signal.Signals(signum).name
    logging.getLogger(__name__).warning("%s %.2f s after a cell began (seed %d)", name, delay,
                                        seed)
    deadline = time.monotonic() + 120
    while not any("sweep: cell " in line for line in errors):
        assert process.poll() is None and time.monotonic() < deadline, errors[-20:]
        time.sleep(0.02)
    time.sleep(delay)
    tree = _descendants(process.pid)
    names = {pid: _command_line(pid) for pid in tree}
    assert process.poll() is None, f"the sweep ended before the signal (delay {delay:.2f} s)"
    assert any("spawn_main" in name for name in names.values()), names
    process.send_signal(signum)
    stdout = process.stdout.read()
    process.wait(timeout=120)
    reader.join(timeout=10)
    workers = {pid for pid, name in names.items() if "spawn_main" in name}
    assert not {pid for pid in workers if _alive(pid)}, "a worker outlived the sweep"
    left = {pid for pid in tree if _alive(pid)}
    for _ in range(40):  # multiprocessing's resource tracker leaves once its pipe closes
        left = {pid for pid in left if _alive(pid)}
        if not left:
            break
        time.sleep(0.05)
    stderr = "".join(errors)
    assert process.returncode == 128 + signum, stderr[-3000:]
    lines = (stdout + stderr).splitlines()
    about = [line for line in lines if ABOUT_THE_STOP.search(line.replace(str(out), ""))]
    assert about == [stderr.splitlines()[-1]], about
    stopped = re.fullmatch(rf"mgloop\.sweep: stopped by {name}: (\d) of 4 cells done"
                           rf"(?:, cell (.+) saved at step (\d+) of {STEPS})?; run the same command "
                           r"to resume", about[0])
    assert stopped, about[0]
    assert not [line for line in lines if TENSORFLOW_START_UP.search(line)]
    assert not left, f"processes left: {left}"
    assert not [f for _, _, files in os.walk(out) for f in files if f == "mgloop.lock"]
    plan = _plan(out)
    if stopped.group(2):
        cell = next(c for c in plan.cells() if c.name == stopped.group(2))
        assert os.path.exists(os.path.join(plan.logdir(cell), "checkpoints",
                                           f"ckpt-{stopped.group(3)}.index"))
    assert len(report.load(str(out))) == int(stopped.group(1))
    return stopped


def test_sigint_then_sigterm_stop_the_sweep_cleanly_and_the_reruns_resume_it_exactly(
        tmp_path, caplog):
    """The sweep's command stopped by SIGINT, its rerun by SIGTERM (each checked by
    `_stop_at_random`), then a rerun to the end (in this process): the finished cells are
    skipped without a word, a stopped one resumed from its checkpoint, and the records
    equal those of the sweep never stopped, bit for bit."""
    reference = _plan(tmp_path / "reference")
    runner.run(reference)
    out = tmp_path / "sweep"
    first = _stop_at_random(out, signal.SIGINT, 1.0)
    assert int(first.group(1)) <= 2  # left cells for the rerun to be stopped in
    second = _stop_at_random(out, signal.SIGTERM, 0.5)
    with caplog.at_level(logging.INFO, logger="absl"):
        runner.run(_plan(out))
    resumed = [r.getMessage() for r in caplog.records if "resumed from" in r.getMessage()]
    assert len(resumed) == (1 if second.group(2) else 0), resumed
    assert not [r for r in caplog.records if "differ" in r.getMessage()]
    assert _exact(report.load(str(out))) == _exact(report.load(reference.output_dir))


def test_bad_flag_values_are_refused_in_one_line_before_tensorflow_loads(tmp_path):
    """--seeds=0 (runs/sweep/checks.py), a non-number, an unknown flag (absl, while the
    flags are parsed): exit code 2 and one line on stderr, before TensorFlow loads; no output
    folder. (A bad --vary or --set item or cell: tests/test_sweep.py, by the command line and
    by runner.run.)"""
    out = tmp_path / "sweep"
    base = [sys.executable, "-m", "mgloop.sweep", f"--output_dir={out}",
            "--set=model=mlp", "--set=devices=cpu:2", "--set=train_steps=4"]
    for extra, says in ((["--seeds=0"], "--seeds=0 is out of range: must be >= 1"),
                        (["--evals=x"], "flag --evals=x: invalid literal"),
                        (["--sets=model=mlp"], "Unknown command line flag 'sets'")):
        done = subprocess.run(base + extra, capture_output=True, text=True, cwd=REPO,
                              timeout=300, env=_quiet_environment())
        assert done.returncode == 2, done.stderr[-2000:]
        assert done.stderr.startswith(f"mgloop.sweep: error: {says}"), done.stderr
        assert len(done.stderr.splitlines()) == 1 and not done.stdout, done.stderr
        assert not out.exists()
