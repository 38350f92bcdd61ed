"""Faults on a real shaped link: what a job does when a worker's link misbehaves mid-run.

    python -m experiments.link_faults                          (as root: every scenario,
                                                                 plain and --elastic)
    python -m experiments.link_faults --scenarios=down_long --modes=elastic
    python -m experiments.link_faults --json_out=/tmp/link_faults.json

Each scenario is one job of `python -m mgloop.launch --netns` (mgloop/cluster/netns.py: each
worker in a network namespace `mgl<launcher pid>-w<i>`, both ends of its link shaped by tc
tbf to `--rate`), the mlp on one device per worker, a checkpoint every
`--checkpoint_every` steps, `--collective_timeout` (the peer health timeout) short, no
exchange timed alone at the end (`--time_exchange=false`: 100 exchanges, a minute at
2 Mbit/s); once worker 0 logs step `--fault_step` (a checkpoint is on disk by then), this
script acts on the namespaces named after the launcher's pid (it started the launcher):

    down_short   worker 1's link down (`ip -n mgl<pid>-w1 link set mgl<pid>w1 down`) for
                 --down_short seconds (less than --collective_timeout), then up again
    down_long    the same for --down_long seconds (longer than --collective_timeout)
    cut          every link's rate cut from --rate to --cut_rate (`tc -n ... qdisc change
                 ... tbf rate`, both ends of every worker's link) for the rest of the run
    killed       worker 1's process killed (SIGKILL): its link stays up, its server is gone,
                 so its peers' health checks are refused (peer_health.py), where down_long's
                 go unanswered until --collective_timeout
    slow         --slow_workers workers; worker 1's link (both ends) shaped to
                 --rate / --slow_factor from the start (changed as soon as the launcher
                 says its namespaces are made, before the workers have started TensorFlow)

and `--modes`: `plain` (a failed worker ends the job) and `elastic` (`--elastic
--min_workers=1`: the others continue from the last checkpoint; the failed slot rejoins
after --rejoin_seconds). A plain job that stops is run again, unfaulted, with the same
command (`--resume`): the line it logs on start says which checkpoint it resumed from.

One line per job: what was done and when (seconds after the launch, the step worker 0 had
logged), what the job did (exit code; seconds from the fault to the first worker's
failure or lost peer and to the job's stop or elastic restart; the step reached; which checkpoint a
restart or a rerun resumed from, against the newest on disk at the fault; the longest gap
between worker 0's step logs after the fault and its seconds per step before and after;
the final train loss and eval accuracy of summary.json, the same in every job of the same
steps when nothing was lost; "after the last step": a lost peer logged by a worker still
ending its run about one that had finished and exited, not a fault of the job),
whether the checkpoints are intact (every `ckpt-N.index` has its data and the newest one
reads), and what of the launcher's names `ip netns list` and `ip link` still show.
`--json_out`: the rows, the commands and the machine (experiments/benchlib.py's `publish`).
A job that runs past --timeout is recorded as hung and stopped (SIGINT to its launcher,
which stops its workers and removes its namespaces; SIGKILL after a minute more).

Needs root and the launcher's --netns (refused in one line otherwise). About 1 minute a
job on a busy 2-core machine (most of it TensorFlow's start-up and the final eval), 2 to 3
for the slow link's; the figures of docs/multi-worker.md ("Faults on a shaped link").
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from absl import app
from absl import flags

from experiments import benchlib
from experiments import link_check  # experiments/link_check.py: left_behind
from mgloop.cluster import elastic as elastic_lib  # imports no TensorFlow
from mgloop.cluster import netns as netns_lib  # imports no TensorFlow
from mgloop.observe import link_model  # imports no TensorFlow

FLAGS = flags.FLAGS
SCENARIOS = ("down_short", "down_long", "cut", "killed", "slow")
MODES = ("plain", "elastic")
_STEP = re.compile(r"^\[worker 0\] .*\] step (\d+)/\d+")


def define_flags() -> None:
    """The entry's flags (defined only when it runs: tests import this module)."""
    flags.DEFINE_list("scenarios", list(SCENARIOS), f"of {', '.join(SCENARIOS)}")
    flags.DEFINE_list("modes", list(MODES), f"of {', '.join(MODES)}")
    flags.DEFINE_string("rate", "20mbit", "every link's bandwidth (--link=between:)")
    flags.DEFINE_string("cut_rate", "2mbit", "cut: the bandwidth after the cut")
    flags.DEFINE_float("slow_factor", 10.0, "slow: worker 1's link is --rate / this")
    flags.DEFINE_integer("slow_workers", 4, "slow: the job's workers")
    flags.DEFINE_integer("workers", 2, "the other scenarios' workers")
    flags.DEFINE_float("down_short", 2.0, "down_short: seconds the link is down")
    flags.DEFINE_float("down_long", 20.0, "down_long: seconds the link is down")
    flags.DEFINE_float("collective_timeout", 10.0, "the train flag (>= 5)")
    flags.DEFINE_integer("train_steps", 200, "steps of every job but slow")
    flags.DEFINE_integer("slow_steps", 30, "slow: steps of the job")
    flags.DEFINE_integer("fault_step", 120, "the fault comes once worker 0 logged this step")
    flags.DEFINE_integer("global_batch", 96, "the train flag --global_batch_size: the same at "
                         "every worker count (96 splits over 1, 2, 3 and 4 workers), so a "
                         "restart on fewer workers trains as the unfaulted job")
    flags.DEFINE_integer("checkpoint_every", 50, "the train flag")
    flags.DEFINE_integer("log_every", 10, "the train flag (the steps' log: the timeline)")
    flags.DEFINE_float("rejoin_seconds", 20.0, "elastic: the launcher flag")
    flags.DEFINE_bool("resume", True, "plain: run a job that stopped again, unfaulted")
    flags.DEFINE_float("timeout", 300.0, "seconds a job may run before it counts as hung")
    flags.DEFINE_string("output_dir", None, "the jobs' logdirs and logs, each job's folder "
                        "<scenario>-<mode> replaced (default: a new temporary folder)")
    flags.DEFINE_string("json_out", None, "also write the results here as JSON")


class Job:
    """One launcher process, its output lines timestamped (seconds since its start) as they
    come, and written to `log`."""

    def __init__(self, command: list[str], log: str):
        self.command, self.lines, self.began = command, [], time.monotonic()
        self.ended: float | None = None  # seconds: the launcher's output closed (it exited)
        self._changed = threading.Condition()
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env=env)
        self.prefix = f"mgl{self.process.pid}"  # the launcher's names (netns.py)
        self._reader = threading.Thread(target=self._read, args=(log,), daemon=True)
        self._reader.start()

    def _read(self, log: str) -> None:
        with open(log, "w") as out:
            for line in self.process.stdout:
                out.write(line)
                with self._changed:
                    self.lines.append((self.now(), line.rstrip("\n")))
                    self._changed.notify_all()
        self.ended = self.now()

    def now(self) -> float:
        return time.monotonic() - self.began

    def wait_for(self, pattern: str, timeout: float, since: float = 0.0):
        """(seconds, match) of the first line after `since` matching `pattern`, or None at
        the timeout or the launcher's end."""
        found = re.compile(pattern)

        def first():
            for at, line in self.lines:
                match = found.search(line) if at >= since else None
                if match:
                    return at, match
            return None
        deadline = time.monotonic() + timeout
        with self._changed:
            while first() is None and self.process.poll() is None:
                if not self._changed.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
                    if time.monotonic() >= deadline:
                        break
        return first()

    def finish(self, timeout: float) -> tuple[int, bool]:
        """(exit code, hung): waits up to `timeout` s from the start, then SIGINT (a second
        after 60 s, SIGKILL after another 60 s)."""
        for signum in (None, signal.SIGINT, signal.SIGINT, signal.SIGKILL):
            if signum is not None:
                self.process.send_signal(signum)
            try:
                self.process.wait(timeout=max(1.0, timeout - self.now()) if signum is None
                                  else 60)
                break
            except subprocess.TimeoutExpired:
                continue
        self._reader.join(timeout=10)
        return self.process.returncode, signum is not None

    def steps(self) -> list[tuple[float, int]]:
        return [(at, int(m.group(1))) for at, line in self.lines
                for m in [_STEP.search(line)] if m]

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


def ip(*command: str) -> str:
    """One `ip`/`tc` command; '' on success, else what it said (the job may have ended)."""
    done = subprocess.run(list(command), capture_output=True, text=True)
    return "" if done.returncode == 0 else " ".join(done.stderr.split())


def shape(prefix: str, index: int, bits_per_second: float) -> str:
    """Both ends of worker `index`'s link to a new rate (netns.py's tbf arguments)."""
    said = [ip("tc", "-n", f"{prefix}-{where}", "qdisc", "change", "dev", device, "root",
               *netns_lib.tbf(bits_per_second))
            for where, device in ((f"w{index}", f"{prefix}w{index}"), ("hub", f"{prefix}h{index}"))]
    return "; ".join(filter(None, said))


def checkpoints(logdir: str) -> tuple[list[int], str]:
    """(the checkpoints' steps, 'intact' or what is wrong): every index has its data, and
    the newest reads (tf.train.load_checkpoint)."""
    folder = os.path.join(logdir, "checkpoints")
    names = os.listdir(folder) if os.path.isdir(folder) else []
    steps = sorted(int(m.group(1)) for m in map(re.compile(r"ckpt-(\d+)\.index").fullmatch,
                                                 names) if m)
    missing = [s for s in steps if not any(n.startswith(f"ckpt-{s}.data-") for n in names)]
    if missing:
        return steps, f"no data for ckpt-{missing}"
    if not steps:
        return steps, "none"
    import tensorflow as tf
    try:
        variables = tf.train.load_checkpoint(os.path.join(folder, f"ckpt-{steps[-1]}"))
        variables.get_variable_to_shape_map()
    except Exception as error:  # noqa: BLE001  (a checkpoint that does not read: say why)
        return steps, f"ckpt-{steps[-1]} does not read: {type(error).__name__}"
    return steps, "intact"


def command(scenario: str, mode: str, logdir: str) -> list[str]:
    workers = FLAGS.slow_workers if scenario == "slow" else FLAGS.workers
    steps = FLAGS.slow_steps if scenario == "slow" else FLAGS.train_steps
    elastic = (["--elastic", "--min_workers=1", "--max_restarts=2",
                f"--rejoin_seconds={FLAGS.rejoin_seconds:g}"] if mode == "elastic"
               else ["--grace_seconds=20"])
    return [sys.executable, "-m", "mgloop.launch", "--netns", f"--num_workers={workers}",
            "--devices_per_worker=cpu:1", "--stop_seconds=20", *elastic, "--",
            "--model=mlp", "--aggregation=ring", f"--train_steps={steps}",
            f"--global_batch_size={FLAGS.global_batch}", "--steps_per_loop=10",
            f"--log_every={FLAGS.log_every}", "--summary_every=0",
            f"--checkpoint_every={FLAGS.checkpoint_every}",
            f"--collective_timeout={FLAGS.collective_timeout:g}", "--startup_timeout=60",
            f"--logdir={logdir}", "--link=within:100gbit,2us",
            f"--link=between:{FLAGS.rate},50us", "--time_exchange=false"]


def inject(job: Job, scenario: str, rate: float, logdir: str) -> dict:
    """Waits for the moment, does the fault; what was done, when, at which step."""
    if scenario == "slow":
        seen = job.wait_for(r"^\[launch\] netns: \d+ worker namespace", 120)
        if seen is None:
            return {"fault": "none: the namespaces were not made", "fault_at": None}
        problem = shape(job.prefix, 1, rate / FLAGS.slow_factor)
        return {"fault": f"w1's link at {rate / FLAGS.slow_factor / 1e6:g} Mbit/s, the "
                         f"others' {rate / 1e6:g} ({problem or 'from the start'})",
                "fault_at": job.now(), "fault_step": 0, "newest_at_fault": -1}
    seen = job.wait_for(rf"^\[worker 0\] .*\] step ({FLAGS.fault_step}|[1-9]\d{{3,}})/", 240)
    if seen is None:
        return {"fault": f"none: step {FLAGS.fault_step} was not reached", "fault_at": None}
    device, name = f"{job.prefix}w1", f"{job.prefix}-w1"
    at, step = job.now(), job.steps()[-1][1]
    newest = elastic_lib.newest_checkpoint(logdir)
    if scenario.startswith("down"):
        seconds = FLAGS.down_short if scenario == "down_short" else FLAGS.down_long
        problem = ip("ip", "-n", name, "link", "set", device, "down")
        time.sleep(seconds)
        problem += ip("ip", "-n", name, "link", "set", device, "up")  # '' or: the job ended
        what = f"w1's link down {seconds:g} s" + (f" (up: {problem})" if problem else "")
    elif scenario == "killed":
        started = job.wait_for(r"^\[launch\] worker 1 at \S+ started \(pid (\d+)\)", 0)
        if started is None:
            return {"fault": "none: worker 1's pid was not logged", "fault_at": None}
        os.kill(int(started[1].group(1)), signal.SIGKILL)
        what = "w1's process killed (SIGKILL)"
    else:
        cut = link_model.parse(f"between:{FLAGS.cut_rate},0us").bytes_per_second * 8
        problem = "; ".join(filter(None, (shape(job.prefix, i, cut)
                                          for i in range(FLAGS.workers))))
        what = f"every link cut {rate / 1e6:g} -> {cut / 1e6:g} Mbit/s" + (
            f" ({problem})" if problem else "")
    return {"fault": what, "fault_at": at, "fault_step": step, "newest_at_fault": newest}


def timeline(job: Job, fault_at: float | None) -> dict:
    """Worker 0's seconds per step before and after the fault, the longest gap between its
    step logs after it; the first failure, stop or restart after it."""
    steps, out = job.steps(), {}
    fault_at = fault_at or 0.0
    before = [(a, s) for a, s in steps if a <= fault_at]
    after = [(a, s) for a, s in steps if a > fault_at]
    for key, part in (("step_seconds_before", before), ("step_seconds_after", after)):
        rising = [(a, s) for a, s in part if s > part[0][1]] if part else []
        out[key] = ((rising[-1][0] - part[0][0]) / (rising[-1][1] - part[0][1])
                    if rising else None)
    marks = [fault_at] + [a for a, _ in after]
    out["longest_gap"] = max((b - a for a, b in zip(marks, marks[1:])), default=None)
    out["step_reached"] = max((s for _, s in steps), default=0)
    failed = job.wait_for(r"^\[launch\] worker \d+ (exited|was killed|stopped answering)|"
                          r"answered no health check|refused \d+ health checks", 0, since=fault_at)
    out["to_failure"] = failed[0] - fault_at if failed else None
    # a worker that finished first and exited, declared lost by one still ending its run
    out["after_last_step"] = bool(failed and steps and failed[0] > steps[-1][0]
                                  and job.process.returncode == 0)
    restart = job.wait_for(r"^\[launch\] round of (\d+) worker\(s\) from the checkpoint of "
                           r"step (\d+)", 0, since=fault_at)
    out["to_restart"] = restart[0] - fault_at if restart else None
    out["resumed_from"] = int(restart[1].group(2)) if restart else None
    out["to_end"] = (job.ended if job.ended is not None else job.now()) - fault_at
    return out


def run_one(scenario: str, mode: str, output: str) -> dict:
    folder = os.path.join(output, f"{scenario}-{mode}")
    shutil.rmtree(folder, ignore_errors=True)  # an earlier job's checkpoints would resume
    os.makedirs(folder)
    logdir = os.path.join(folder, "logdir")
    rate = link_model.parse(f"between:{FLAGS.rate},0us").bytes_per_second * 8
    job = Job(command(scenario, mode, logdir), os.path.join(folder, "launch.log"))
    fault = inject(job, scenario, rate, logdir)
    code, hung = job.finish(FLAGS.timeout)
    row = {"scenario": scenario, "mode": mode, **fault, "exit_code": code, "hung": hung,
           **timeline(job, fault["fault_at"]),
           "left_behind": link_check.left_behind(job.process.pid),
           "command": job.command, "log": os.path.join(folder, "launch.log")}
    if code != 0 and mode == "plain" and FLAGS.resume and not hung:
        again = Job(job.command, os.path.join(folder, "resume.log"))
        row["resume_exit_code"], _ = again.finish(FLAGS.timeout)
        found = re.search(r"resumed from \S+ at step (\d+)", again.text())
        row["resumed_from"] = int(found.group(1)) if found else None
        row["rerun_reached"] = max((s for _, s in again.steps()), default=0)
        row["left_behind"] += link_check.left_behind(again.process.pid)
    row["checkpoints"], row["checkpoints_state"] = checkpoints(logdir)
    row.update(summary_figures(logdir, rate, scenario == "slow"))
    return row


def summary_figures(logdir: str, rate: float, slow: bool) -> dict:
    """The final train loss and eval accuracy of summary.json (the last run's: the same as
    the unfaulted job's when nothing was lost); `slow`: the median step against the link
    model's exchange at the fast and at the slow rate."""
    import json
    path = os.path.join(logdir, "summary.json")
    if not os.path.exists(path):
        return {}
    with open(path) as handle:
        summary = json.load(handle)
    out = {"final_loss": summary.get("final_train_loss"),
           "eval_accuracy": summary.get("eval_accuracy")}
    if slow and summary.get("link_model"):
        sent = summary["link_model"]["bytes_per_device"] * 8
        out.update(median_step=summary["median_step_time"], modelled_fast=sent / rate,
                   modelled_slow=sent / (rate / FLAGS.slow_factor))
    return out


def line(row: dict) -> str:
    """The one line of a job."""
    def s(value):
        return "-" if value is None else f"{value:.1f} s"
    if row["fault_at"] is None:
        return f"{row['scenario']}, {row['mode']}: {row['fault']}; exit {row['exit_code']}"
    parts = [f"{row['scenario']}, {row['mode']}: {row['fault']} at {row['fault_at']:.0f} s "
             f"(step {row['fault_step']}, newest checkpoint {row['newest_at_fault']})",
             f"exit {row['exit_code']}" + (" (HUNG: stopped by this script)" if row["hung"]
                                           else ""),
             f"fault->first failure or lost peer {s(row['to_failure'])}"
             f"{' (after the last step)' if row.get('after_last_step') else ''}, ->restart "
             f"{s(row['to_restart'])}, "
             f"->end {s(row['to_end'])}",
             f"step reached {row['step_reached']}"]
    if row.get("resumed_from") is not None:
        parts.append(f"resumed from step {row['resumed_from']}"
                     + (f" (rerun: exit {row['resume_exit_code']}, step "
                        f"{row['rerun_reached']})" if "resume_exit_code" in row else ""))
    gap = row["longest_gap"]
    parts.append(f"longest gap {s(gap)}, s/step {row['step_seconds_before'] or 0:.3f} -> "
                 f"{row['step_seconds_after'] or 0:.3f}")
    if "median_step" in row:
        parts.append(f"median step {row['median_step'] * 1e3:.0f} ms (modelled "
                     f"{row['modelled_fast'] * 1e3:.0f} at the fast rate, "
                     f"{row['modelled_slow'] * 1e3:.0f} at the slow)")
    if row.get("final_loss") is not None:
        parts.append(f"final train loss {row['final_loss']:.4f}, eval accuracy "
                     f"{row['eval_accuracy']:.4f}")
    parts.append(f"checkpoints {row['checkpoints']} {row['checkpoints_state']}")
    parts.append("left behind: " + (", ".join(row["left_behind"]) or "nothing"))
    return "; ".join(parts)


COLUMNS = [("scenario", "scenario", "s"), ("mode", "mode", "s"), ("exit_code", "exit", "d"),
           ("fault_step", "fault at step", "d"), ("to_failure", "to failure (s)", ".1f"),
           ("to_restart", "to restart (s)", ".1f"), ("to_end", "to end (s)", ".1f"),
           ("step_reached", "step reached", "d"), ("resumed_from", "resumed from", "d"),
           ("final_loss", "final loss", ".4f"),
           ("longest_gap", "longest gap (s)", ".1f")]


def main(argv):
    del argv
    unknown = ([s for s in FLAGS.scenarios if s not in SCENARIOS]
               + [m for m in FLAGS.modes if m not in MODES])
    if unknown:
        raise app.UsageError(f"unknown: {', '.join(unknown)}; scenarios {SCENARIOS}, "
                             f"modes {MODES}")
    rate = link_model.parse(f"between:{FLAGS.rate},0us").bytes_per_second * 8
    problem = netns_lib.refusal(max(FLAGS.workers, FLAGS.slow_workers),
                                netns_lib.Shaping(rate / FLAGS.slow_factor, 0.0))
    if problem:
        print(f"link_faults: error: {problem}", file=sys.stderr)
        return 2
    output = FLAGS.output_dir or tempfile.mkdtemp(prefix="link_faults-")
    rows = []
    for scenario in FLAGS.scenarios:
        for mode in FLAGS.modes:
            rows.append(run_one(scenario, mode, output))
            print(line(rows[-1]), flush=True)
    benchlib.publish(f"mlp, ring, one device per worker, links at {FLAGS.rate}, "
                     f"--collective_timeout={FLAGS.collective_timeout:g}", rows, COLUMNS,
                     FLAGS.json_out, settings={"output_dir": output, **{
                         name: FLAGS[name].value for name in (
                             "rate", "cut_rate", "slow_factor", "slow_workers", "workers",
                             "down_short", "down_long", "collective_timeout", "train_steps", "global_batch",
                             "slow_steps", "fault_step", "checkpoint_every",
                             "rejoin_seconds")}})
    return 1 if any(r["hung"] or r["left_behind"] for r in rows) else 0


if __name__ == "__main__":
    define_flags()
    app.run(main)
