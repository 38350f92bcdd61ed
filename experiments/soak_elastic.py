"""Failure soak: an elastic job whose workers are killed with SIGKILL every few minutes.

    python -m experiments.soak_elastic --minutes=30 --kill_every_minutes=3 [--json_out=F]

Runs `python -m mgloop.launch --elastic --num_workers=3 --min_workers=2 ...` on DiLoCo
(H = 8) over the digits mlp at the default summary, log and checkpoint cadence, with
--train_steps set so that the job takes about --minutes: a plain 3-worker run of the same
flags is timed first for --calibrate_seconds (its step rate from its checkpoints), and the
restarts' start-up is budgeted at --restart_seconds each. Every --kill_every_minutes a
live worker, drawn with --seed (the chief too), is killed with SIGKILL; the launcher goes
on with the others and takes the slot back (--rejoin_seconds).

It reports:
- whether the job ended by itself at its step count (exit code 0, summary.json's
  final_step);
- for every round, the step it resumed from against the newest checkpoint on disk when
  its workers started (a checkpoint is lost if a round resumes from an older one);
- the launcher's RSS and threads over the whole soak (it lives throughout) and every
  worker process's first and last samples after --warmup_seconds (each lives one round),
  with the least-squares slopes of experiments/soak.py;
- the job's final eval accuracy against the same flags and step count trained without
  failures on 3 simulated nodes in one process (--baseline_seeds seeds): the soak fails
  (exit code 1) unless the job's accuracy is at least the seeds' lowest minus 3 sd (the
  rule of tests/test_elastic.py) and above --min_accuracy. An exit code alone would pass
  a job that ended at chance.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

from experiments import soak  # (experiments/soak.py: /proc readers and slopes)

from mgloop.cluster import elastic  # (imports no TensorFlow)

_FLAGS = flags.FLAGS  # --minutes (set to 30 below), --interval, --json_out: soak.py's
flags.DEFINE_float("kill_every_minutes", 3.0, "minutes between two SIGKILLs")
flags.DEFINE_float("calibrate_seconds", 60.0, "the plain run timed to set --train_steps")
flags.DEFINE_float("restart_seconds", 40.0, "start-up time budgeted per restart")
flags.DEFINE_float("rejoin_seconds", 60.0, "the launcher's --rejoin_seconds")
flags.DEFINE_float("warmup_seconds", 60.0, "a worker's samples before this are left out")
flags.DEFINE_integer("seed", 0, "which worker each kill hits")
flags.DEFINE_integer("baseline_seeds", 3, "seeds of the unfailed run on simulated nodes")
flags.DEFINE_float("min_accuracy", 0.5, "a floor far above chance (0.1) for the job's "
                   "final eval accuracy, whatever the baseline")
flags.DEFINE_integer("train_steps", 0, "the job's step count (0: from the calibration; on a "
                     "loaded machine the restarts' start-up dominates: give it instead)")

# The rate of docs/multi-worker.md's example: at 0.05 the outer Nesterov step (0.7, 0.9)
# over the inner heavy-ball steps drives this mlp to chance after about 2,000 steps, with
# or without failures (docs/multi-worker.md says why)
TRAIN = ["--aggregation=diloco:period=8", "--model=mlp", "--dataset=digits",
         "--global_batch_size=96", "--steps_per_loop=20", "--learning_rate=0.02"]
LAUNCH = [sys.executable, "-m", "mgloop.launch", "--num_workers=3",
          "--devices_per_worker=cpu:1"]


def set_aside(logdir: str, step: int) -> bool:
    """Whether checkpoint `step` was skipped as incomplete (a node's part missing)."""
    return os.path.exists(os.path.join(logdir, "checkpoints", f"ckpt-{step}.index.incomplete"))


def calibrate(seconds: float) -> float:
    """Steps per second of a plain 3-worker run of TRAIN, after its first checkpoint."""
    logdir = tempfile.mkdtemp(prefix="mgloop-calibrate-")
    process = subprocess.Popen([*LAUNCH, "--", f"--logdir={logdir}", "--train_steps=100000000",
                                "--checkpoint_every=200", *TRAIN],
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                               start_new_session=True)
    while elastic.newest_checkpoint(logdir) <= 0 and process.poll() is None:
        time.sleep(0.5)
    first, began = elastic.newest_checkpoint(logdir), time.monotonic()
    time.sleep(seconds)
    rate = (elastic.newest_checkpoint(logdir) - first) / (time.monotonic() - began)
    process.send_signal(signal.SIGINT)  # the launcher stops its workers (own groups), then
    try:  # itself; a SIGKILL to the launcher alone would leave the workers running
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)  # a second signal: the workers are killed
        process.wait()
    return rate


def baseline(steps: int, seeds: int) -> list[float]:
    """The final eval accuracy of TRAIN for `steps` on 3 simulated nodes in one process
    (no failures), one per seed 0..seeds-1."""
    out = []
    for seed in range(seeds):
        logdir = tempfile.mkdtemp(prefix="mgloop-elastic-baseline-")
        subprocess.run([sys.executable, "-m", "mgloop.train", "--devices=cpu:3", "--nodes=3",
                        f"--seed={seed}", f"--logdir={logdir}", f"--train_steps={steps}",
                        "--checkpoint_every=0", *TRAIN], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        with open(os.path.join(logdir, "summary.json")) as handle:
            out.append(json.load(handle)["eval_accuracy"])
    return out


def accuracy_verdict(accuracy, unfailed: list[float], floor: float) -> tuple[bool, float]:
    """(whether the job's final eval `accuracy` holds, the bound it was held to): at least
    the unfailed seeds' lowest minus 3 sd, and above `floor`."""
    bound = max(floor, min(unfailed) - 3 * statistics.pstdev(unfailed)) if unfailed else floor
    return accuracy is not None and accuracy >= bound, bound


def main(argv):
    kills = int(_FLAGS.minutes // _FLAGS.kill_every_minutes)
    rate, steps = None, _FLAGS.train_steps
    if not steps:
        rate = calibrate(_FLAGS.calibrate_seconds)
        budget = 60 * _FLAGS.minutes - kills * 2 * _FLAGS.restart_seconds  # leave and rejoin
        steps = max(1000, int(rate * budget) // 200 * 200)
    logdir = tempfile.mkdtemp(prefix="mgloop-elastic-soak-")
    command = [*LAUNCH, "--elastic", "--min_workers=2", f"--max_restarts={kills + 1}",
               f"--rejoin_seconds={_FLAGS.rejoin_seconds}", "--", f"--logdir={logdir}",
               f"--train_steps={steps}", *TRAIN]
    print(f"soak: {rate or 0:.0f} steps/s calibrated; {' '.join(command)}", flush=True)
    log_path = os.path.join(tempfile.gettempdir(), f"mgloop-elastic-soak-{os.getpid()}.log")
    log = open(log_path, "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    draw, began = random.Random(_FLAGS.seed), time.monotonic()
    samples: dict[int, list] = {process.pid: []}
    killed, next_kill = [], 60 * _FLAGS.kill_every_minutes
    while process.poll() is None:
        now = time.monotonic() - began
        workers = soak.children(process.pid)
        for pid in [process.pid, *workers]:
            value = soak.status(pid)
            if value is not None:
                samples.setdefault(pid, []).append((now, *value))
        if now >= next_kill and len(workers) == 3 and len(killed) < kills:
            victim = draw.randrange(3)
            os.kill(workers[victim], signal.SIGKILL)
            killed.append({"minute": now / 60, "worker": victim,
                           "step": elastic.newest_checkpoint(logdir)})
            print(f"soak: minute {now / 60:.1f}: killed worker {victim} (pid "
                  f"{workers[victim]})", flush=True)
            next_kill = now + 60 * _FLAGS.kill_every_minutes
        time.sleep(_FLAGS.interval)
    log.close()
    minutes = (time.monotonic() - began) / 60
    text = open(log_path).read()
    rounds = [dict(workers=int(m.group(1)), newest=int(m.group(2))) for m in re.finditer(
        r"\[launch\] round of (\d) worker\(s\) from the checkpoint of step (\d+)", text)]
    resumed = [int(m.group(1)) for m in re.finditer(
        r"\[worker 0\] .*resumed from .* at step (\d+)", text)]
    for row, step in zip(rounds[1:], resumed):
        row["resumed"] = step
    with open(os.path.join(logdir, "summary.json")) as handle:
        summary = json.load(handle)
    final, accuracy = summary.get("final_step"), summary.get("eval_accuracy")
    unfailed = baseline(steps, _FLAGS.baseline_seeds)
    holds, bound = accuracy_verdict(accuracy, unfailed, _FLAGS.min_accuracy)
    launcher = soak.slopes(samples.pop(process.pid), 10.0)  # after Python's start-up
    workers = [dict(pid=pid, start_minute=rows[0][0] / 60, last_rss_mb=rows[-1][1] / 1024,
                    last_threads=rows[-1][2],
                    **soak.slopes(rows, rows[0][0] + _FLAGS.warmup_seconds))
               for pid, rows in samples.items() if rows]
    results = dict(command=command, minutes=minutes, train_steps=steps, final_step=final,
                   exit_code=process.returncode, kills=killed, rounds=rounds,
                   lost_checkpoints=sum(r.get("resumed", r["newest"]) < r["newest"]
                                        and not set_aside(logdir, r["newest"])
                                        for r in rounds),
                   launcher=launcher, workers=workers, log=log_path,
                   eval_accuracy=accuracy, unfailed_eval_accuracy=unfailed,
                   accuracy_bound=bound, accuracy_holds=holds)
    print(f"ended with exit code {process.returncode} after {minutes:.1f} min at step "
          f"{final} of {steps}; {len(killed)} kills, {len(rounds)} rounds, "
          f"{results['lost_checkpoints']} checkpoint(s) lost")
    print(f"eval accuracy {accuracy} against the unfailed run's {unfailed} (3 simulated "
          f"nodes): {'holds' if holds else 'FAILS'} the bound {bound:.4f}")
    print(f"launcher: RSS {launcher['rss_mb_first_last'][0]:.1f} -> "
          f"{launcher['rss_mb_first_last'][1]:.1f} MB ({launcher['rss_mb_per_min']:+.3f} "
          f"MB/min), threads {launcher['threads_first_last']}")
    print("worker processes in start order (each lives one round): start minute, last "
          "RSS MB, last threads, and after the warm-up the slope of RSS (MB/min)")
    for w in workers:
        slope = (f"{w['rss_mb_per_min']:+.3f} over {w['samples']} samples"
                 if "rss_mb_per_min" in w else "too short a round for a slope")
        print(f"  pid {w['pid']:>7} {w['start_minute']:6.1f} {w['last_rss_mb']:8.1f} "
              f"{w['last_threads']:5d}  {slope}")
    if _FLAGS.json_out:
        with open(_FLAGS.json_out, "w") as handle:
            json.dump(results, handle, indent=2)
    ok = process.returncode == 0 and final == steps and holds
    return 0 if ok else 1


if __name__ == "__main__":
    flags.FLAGS.set_default("minutes", 30.0)
    app.run(main)
