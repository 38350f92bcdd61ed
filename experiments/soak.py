"""Soak: resident memory and threads of every worker over a long run, as slopes.

    python -m experiments.soak --workers=1 --minutes=10 [--json_out=soak.json] [-- train flags]
    python -m experiments.soak --workers=2 --minutes=10

Runs `python -m mgloop.train --model=mlp --devices=cpu:2` (1 worker) or
`python -m mgloop.launch --num_workers=2 --devices_per_worker=cpu:1 -- --model=mlp`
(2 workers) with --train_steps large enough not to finish, at the default summary,
log and checkpoint cadence, for --minutes. Every --interval seconds it reads VmRSS and
Threads of each worker process from /proc/<pid>/status (Linux). At the end it stops
the run (SIGTERM to its process group, SIGKILL after 30 s) and reports, per worker, the
least-squares slopes over the samples after --warmup_minutes: RSS in MB per minute and
threads per minute, with first and last values, as a table and as JSON (--json_out).
A worker that ends before the time is up is reported with its exit code.

Growth per step (KiB/step) is reported beside the slope per minute, since machines
differ in steps per minute: steps/min is the final step (summary.json, written on
the SIGTERM) over the minutes the run went on, start-up included, so it is a lower
bound of the steady rate and KiB/step an upper bound of the steady growth.

`--hooks=every` switches on every hook that runs per loop or per step, on top of the
defaults (which already have diagnostics, summaries, log lines and checkpoints):
HOOK_FLAGS below (histograms, evaluation, gradient accumulation, mixed precision
and a stateful aggregation method, top-k with error feedback; mixed_bfloat16 with
several workers, where mixed_float16 is refused).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

_FLAGS = flags.FLAGS
flags.DEFINE_integer("workers", 1, "1: mgloop.train; 2 or more: mgloop.launch")
flags.DEFINE_float("minutes", 10.0, "how long the run goes on")
flags.DEFINE_float("warmup_minutes", 2.0, "samples before this are left out of the slopes")
flags.DEFINE_float("interval", 5.0, "seconds between samples")
flags.DEFINE_string("model", "mlp", "--model of the run")
flags.DEFINE_string("devices", "cpu:2", "--devices of the one worker (--workers=1)")
flags.DEFINE_string("devices_per_worker", "cpu:1", "--devices_per_worker (--workers>1)")
flags.DEFINE_string("logdir", None, "the run's --logdir (default: a fresh temporary folder)")
flags.DEFINE_string("json_out", None, "also write the results here as JSON")
flags.DEFINE_enum("hooks", "defaults", ["defaults", "every"],
                  "defaults: the run's default flags; every: and HOOK_FLAGS")

# Every hook a run can switch on, added by --hooks=every; across workers
# mixed_bfloat16 (mgloop refuses mixed_float16's loss scaling across workers).
HOOK_FLAGS = ["--histogram_every=100", "--eval_every=1000", "--accumulation_steps=2",
              "--aggregation=topk:ratio=0.01"]


def hook_flags() -> list[str]:
    if _FLAGS.hooks != "every":
        return []
    precision = "mixed_float16" if _FLAGS.workers == 1 else "mixed_bfloat16"
    return HOOK_FLAGS + [f"--mixed_precision={precision}"]


def command(train_flags: list[str], logdir: str) -> list[str]:
    common = [f"--model={_FLAGS.model}", "--train_steps=1000000000", f"--logdir={logdir}",
              *hook_flags(), *train_flags]
    if _FLAGS.workers == 1:
        return [sys.executable, "-m", "mgloop.train", f"--devices={_FLAGS.devices}", *common]
    return [sys.executable, "-m", "mgloop.launch", f"--num_workers={_FLAGS.workers}",
            f"--devices_per_worker={_FLAGS.devices_per_worker}", "--", *common]


def status(pid: int) -> tuple[int, int] | None:
    """(VmRSS KiB, Threads) of `pid`, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            fields = dict(line.split(":", 1) for line in handle if ":" in line)
        return int(fields["VmRSS"].split()[0]), int(fields["Threads"])
    except (OSError, KeyError, ValueError):
        return None


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid`, by pid."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
            found.append(int(name))
    return sorted(found)


def worker_pids(process: subprocess.Popen) -> list[int]:
    if _FLAGS.workers == 1:
        return [process.pid]
    return children(process.pid)  # the launcher's workers, in start order


def slopes(samples: list[tuple[float, int, int]], warmup: float) -> dict:
    """Least-squares slopes of RSS (MB/min) and threads (/min) over samples after `warmup` s."""
    kept = [s for s in samples if s[0] >= warmup]
    out = {"samples": len(kept)}
    if len(kept) >= 2:
        t = np.array([s[0] for s in kept]) / 60.0
        out["rss_mb_per_min"] = float(np.polyfit(t, [s[1] / 1024 for s in kept], 1)[0])
        out["threads_per_min"] = float(np.polyfit(t, [s[2] for s in kept], 1)[0])
        out["rss_mb_first_last"] = [kept[0][1] / 1024, kept[-1][1] / 1024]
        out["threads_first_last"] = [kept[0][2], kept[-1][2]]
    return out


def final_step(logdir: str) -> int | None:
    """The step the run ended at (summary.json of the chief, written on SIGTERM)."""
    try:
        with open(os.path.join(logdir, "summary.json")) as handle:
            return int(json.load(handle)["final_step"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def main(argv):
    train_flags = argv[1:]
    logdir = _FLAGS.logdir or tempfile.mkdtemp(prefix="mgloop-soak-")
    cmd = command(train_flags, logdir)
    print("soak:", " ".join(cmd), flush=True)
    log = open(os.path.join(tempfile.gettempdir(), f"mgloop-soak-{os.getpid()}.log"), "w")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    began = time.monotonic()
    samples: dict[int, list[tuple[float, int, int]]] = {}
    order: list[int] = []
    try:
        while time.monotonic() - began < 60 * _FLAGS.minutes and process.poll() is None:
            now = time.monotonic() - began
            for pid in worker_pids(process):
                if pid not in samples:
                    samples[pid] = []
                    order.append(pid)
                value = status(pid)
                if value is not None:
                    samples[pid].append((now, *value))
            time.sleep(_FLAGS.interval)
    finally:
        ended = process.poll()
        if ended is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        log.close()
    elapsed = (time.monotonic() - began) / 60
    steps = final_step(logdir)
    steps_per_min = steps / elapsed if steps else None
    results = {"command": cmd, "minutes": _FLAGS.minutes, "final_step": steps,
               "steps_per_min": steps_per_min, "warmup_minutes": _FLAGS.warmup_minutes,
               "interval": _FLAGS.interval, "ended_early_with": ended, "log": log.name,
               "workers": [dict(worker=i, pid=pid, **slopes(samples[pid],
                                                            60 * _FLAGS.warmup_minutes))
                           for i, pid in enumerate(order)]}
    for row in results["workers"]:
        if steps_per_min and "rss_mb_per_min" in row:
            row["rss_kib_per_step"] = row["rss_mb_per_min"] * 1024 / steps_per_min
    print(f"{'worker':>6} {'samples':>7} {'RSS MB first→last':>20} {'MB/min':>8} "
          f"{'KiB/step':>9} {'threads first→last':>19} {'threads/min':>11}")
    for row in results["workers"]:
        if "rss_mb_per_min" not in row:
            print(f"{row['worker']:>6} {row['samples']:>7}  (too few samples after warm-up)")
            continue
        rss, threads = row["rss_mb_first_last"], row["threads_first_last"]
        print(f"{row['worker']:>6} {row['samples']:>7} {rss[0]:>9.1f}→{rss[1]:<9.1f} "
              f"{row['rss_mb_per_min']:>8.3f} {row.get('rss_kib_per_step', float('nan')):>9.4f} "
              f"{threads[0]:>9d}→{threads[1]:<8d} "
              f"{row['threads_per_min']:>11.2f}")
    print(f"steps: {steps} in {elapsed:.1f} min ({steps_per_min or 0:.0f} steps/min, "
          "start-up included)")
    if ended is not None:
        print(f"the run ended early with exit code {ended} (log: {log.name})")
    if _FLAGS.json_out:
        with open(_FLAGS.json_out, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    app.run(main)
