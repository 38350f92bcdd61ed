"""Real workers on real slow links: the measured step against the link model's.

    python -m experiments.link_check --json_out=/tmp/link_check.json     (as root)
    python -m experiments.link_check --methods=ring --workers=2 --bandwidths=50mbit --steps=40
    python -m experiments.link_check --from_json=/tmp/link_check.json   (the table again)

For every method of `--methods` (and `--method`) and every worker count of `--workers`, one
job on loopback (`python -m mgloop.launch`, no --netns: the unshaped job) and, per bandwidth
of `--bandwidths`, one job of `python -m mgloop.launch --netns` (each worker in its own
network namespace, both ends of its link shaped by tc tbf to the bandwidth:
mgloop/cluster/netns.py), all of the same job: `--model` (the mlp) on `--devices_per_worker`
= cpu:1, `--steps` steps of `--global_batch` examples, every step its own compiled loop
(`--steps_per_loop=1`) with its own summary (`--summary_every=1`), so that the chief's
TensorBoard scalar `train/step_time` holds the time of each step (all but the first, which
traces the loop). Each job is one launch; the figures are medians over its steps. One step
per call costs a call's overhead per step (the summary is written between the calls,
untimed), in the unshaped job's step and compute too, so the model's C carries it; the
chief, the last to enter each step's collective, times compute and exchange without the
wait for slower peers.

Reported per cell (method, workers, bandwidth), in ms:

    unshaped         the unshaped job's median step: the compute and TensorFlow's
                     transport on loopback, the baseline of the cell
    median step      the shaped job's median step (its summary.json's median_step_time)
    sync step        methods that sync on a schedule (diloco every H steps, each fragment
                     of streaming_diloco every H steps at its own offset): the steps are
                     grouped by the method's occasions (aggregation/traffic.py: "sync",
                     "fragment p", "fragment p merge", "warmup", the others), each group's
                     median taken apart; the sync step is the sync groups' medians weighted
                     by their steps (fragments differ in size); merge step: with an overlap
                     (streaming_diloco's tau), the same over the steps that apply a result
                     tau steps after its send
    step             the shaped job's step averaged over the run as the link model
                     averages it: every group's median weighted by its share of the timed
                     steps; the median step for a method that sends on every step
    modelled         the link model's step at the cell's bandwidth, without and with
                     overlap (summary.json's link_model, step_seconds_no_overlap and
                     step_seconds_overlap), from the UNSHAPED job's summary, which models
                     every bandwidth of --bandwidths (--link=between:, repeated): its
                     compute C is its median step less its exchange timed alone on
                     loopback. (A shaped job's own C is its step less its exchange timed
                     alone on the slow link, about 0: the link model's compute is lost.)
    ratio            step / the modelled step the method claims: with overlap for a method
                     whose exchange is recorded as overlapping later steps' compute
                     (streaming_diloco with tau > 0 or eager), else without; `ok` when
                     within --tolerance (15%) of 1
    sync modelled    the model's sync step, the one the method claims: C + X_e + X_s
                     without overlap, max(C, X_e) + max(0, X_s - k C) with an overlap of k
                     steps (JSON: both); X_s the link model's exchange of one occurrence of
                     the occasion (summary.json's link_model.syncs: its busiest device's
                     bytes and messages, link_model.py's t_d), X_e the per-step rest of the
                     averaged exchange; weighted over the sync groups as the measured sync
                     step; sync ratio = sync step / sync modelled

    calibrated       the claimed step at the calibrated link of the cell's bandwidth
                     (link_calibration.py: S / (eta B) + S / P + alpha m fitted by least
                     squares over every cell), composed as the model composes
                     (modelled_step); ratio, and `held out`: the ratio to the calibration
                     fitted on the other worker counts' cells, `ok` within --tolerance;
                     for a method that claims an overlap also the ratio to its calibrated
                     step without it (JSON: calibrated_no_overlap_ratio)

The latency of --link=between: is `--latency` (default 0us): on a kernel without netem the
shaped links add none (the launcher says so in one line), so the model is given none
either; the measured per-message cost is then what exceeds the model. JSON (`--json_out`):
every cell's figures, both jobs' commands, logdirs, exit codes and wall seconds, the shaped
job's exchange timed alone and its own link model, and every step's time, with the
command, the settings and the machine (experiments/benchlib.py's `publish`). After each
job the namespaces of its launcher (`mgl<pid>-...`) are looked for: any left is named in the
cell and at the end (the launcher removes them whatever ends the job).

Needs root (--netns); refused in one line before any job runs otherwise. Each cell is one
run, its medians over its own steps: on a busy machine compare a repeat's cells before
trusting a difference of a few percent. The default grid is 72 jobs (8 methods x 2 worker
counts x the unshaped job and 3 bandwidths): about half an hour on a 2-core machine, most
of it the jobs' start-up (about 20 s each: TensorFlow, the cluster, the trace, the final
eval) and, for the dense methods at 10 Mbit/s, the 100 exchanges timed alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

from experiments import benchlib
from experiments import link_calibration  # experiments/link_calibration.py
from mgloop.cluster import netns as netns_lib  # imports no TensorFlow
from mgloop.observe import link_model  # imports no TensorFlow

FLAGS = flags.FLAGS

# label -> --aggregation spec: the methods compared (their defaults but where named)
METHODS = {
    "ring": "ring",
    "collective": "collective",
    "ps_cpu": "ps_cpu",
    "topk": "topk:ratio=0.01",  # error feedback: memory=residual, the default
    "powersgd": "powersgd",  # rank 2, error feedback, warm start: the defaults
    "signsgd1": "signsgd:bits=1",  # 1-bit signs, majority vote, scaled
    "diloco": "diloco:period=16",
    "streaming_diloco": "streaming_diloco:period=16,fragments=4,tau=2",  # overlap: tau
}
WITHIN = "100gbit,2us"  # the link inside a worker (one device each: nothing crosses it)
SECONDS = 1e3  # table cells in ms


def define_flags() -> None:
    """The entry's flags (defined only when it runs: tests import this module)."""
    flags.DEFINE_list("methods", list(METHODS), f"labels of the methods: {', '.join(METHODS)}")
    flags.DEFINE_multi_string("method", [], "an --aggregation spec (NAME or NAME:key=value,"
                              "...) measured after --methods; repeatable")
    flags.DEFINE_list("workers", ["2", "4"], "worker counts (one device each)")
    flags.DEFINE_list("bandwidths", ["10mbit", "50mbit", "200mbit"],
                      "the shaped links' bandwidths (--link=between:'s units)")
    flags.DEFINE_string("latency", "0us", "the latency of --link=between: (modelled only: "
                        "this kernel's links add none without netem)")
    flags.DEFINE_integer("steps", 128, "training steps of every job (8 syncs of diloco's H=16)")
    flags.DEFINE_integer("global_batch", 128, "--global_batch_size of every job")
    flags.DEFINE_string("model", "mlp", "--model of every job")
    flags.DEFINE_string("devices_per_worker", "cpu:1", "the launcher's --devices_per_worker")
    flags.DEFINE_multi_string("train_flag", [], "a further train flag of every job, e.g. "
                              "--train_flag=--dataset=digits; repeatable")
    flags.DEFINE_bool("exchange_alone", True, "time the exchange alone at each job's end "
                      "(--time_exchange: 100 exchanges; needed for the unshaped job's compute)")
    flags.DEFINE_float("tolerance", 0.15, "`ok` when |ratio - 1| <= this")
    flags.DEFINE_float("timeout", 900.0, "seconds a job may run before it is stopped (SIGINT "
                       "to its launcher, which stops its workers and removes its namespaces)")
    flags.DEFINE_string("output_dir", None, "the jobs' logdirs and logs (default: a new "
                        "temporary folder)")
    flags.DEFINE_string("json_out", None, "also write the results here as JSON")
    flags.DEFINE_string("from_json", None, "run no job: the table and the calibration again "
                        "from an earlier run's --json_out (its settings, not these flags)")


# --- which steps sync: the methods' own schedules (aggregation/traffic.py's occasions) ----

@dataclasses.dataclass(frozen=True)
class SyncRule:
    """When a method sends on a schedule, in 1-based steps g = s + 1 (s the 0-based global
    step; TensorBoard's step of the loop that ran step s): `period` H (0: every step),
    `warmup` W, the fragments' `offsets` o_p (None: one sync at the period's end), and
    `overlap` k, the steps a sync's exchange may hide behind (streaming_diloco's tau, or H
    when eager), with `merges` when its results are applied tau steps after the send."""

    period: int = 0
    warmup: int = 0
    offsets: tuple[int, ...] | None = None
    overlap: int = 0
    merges: bool = False

    def group(self, g: int) -> str:
        """The occasion of step g as the method names it (aggregation/traffic.py): "warmup"
        (local_steps.py's warmup_occasion), "sync" (its sync_occasion), "fragment p"
        (streaming_diloco.py's fragment_occasions), "fragment p merge"
        (overlap.apply_occasion), or "other" (no scheduled exchange), for s = g - 1."""
        if not self.period:
            return "other"
        if self.offsets is None:
            if g <= self.warmup:
                return "warmup"
            return "sync" if (g - self.warmup) % self.period == 0 else "other"
        for p, offset in enumerate(self.offsets):
            if g % self.period == offset % self.period:
                return f"fragment {p}"
        late = g - self.overlap
        for p, offset in enumerate(self.offsets):
            if self.merges and late >= offset and late % self.period == offset % self.period:
                return f"fragment {p} merge"
        return "other"


def is_sync(name: str) -> bool:
    """Whether a group (an occasion's name) is a step that sends a scheduled sync."""
    return name not in ("other", "warmup") and not name.endswith(" merge")


def sync_rule(spec: str) -> SyncRule:
    """The schedule of the method `spec` names (imports the methods: TensorFlow)."""
    from mgloop.aggregation import registry
    from mgloop.aggregation.local import streaming_diloco
    method, options = registry.parse(spec)
    period = getattr(options, "period", 0)
    if not period:
        return SyncRule()
    if issubclass(method, streaming_diloco.StreamingDiLoCo):
        tau, eager = options.tau, options.eager
        return SyncRule(period, 0, tuple(streaming_diloco.offsets(period, options.fragments)),
                        period if eager else tau, merges=tau > 0)
    return SyncRule(period, getattr(options, "warmup_steps", 0))


# --- the figures of one cell (pure: tested without TensorFlow) ----------------------------

def group_medians(times: dict[int, float], rule: SyncRule) -> dict[str, dict]:
    """{group: {"median": seconds, "steps": count}} of the per-step `times` ({g: seconds})
    by `rule.group`; groups with no step are left out."""
    groups: dict[str, list[float]] = {}
    for g, seconds in sorted(times.items()):
        groups.setdefault(rule.group(g), []).append(seconds)
    return {name: {"median": statistics.median(values), "steps": len(values)}
            for name, values in groups.items()}


def composed(values: dict[str, float], groups: dict[str, dict], which=lambda name: True
             ) -> float | None:
    """sum_g n_g values[g] / sum_g n_g over the `groups` (n_g their timed steps) that
    `which` selects and `values` has; None where none."""
    names = [name for name in groups if which(name) and values.get(name) is not None]
    total = sum(groups[name]["steps"] for name in names)
    if not total:
        return None
    return sum(groups[name]["steps"] * values[name] for name in names) / total


def medians(groups: dict[str, dict]) -> dict[str, float]:
    return {name: group["median"] for name, group in groups.items()}


def sync_modelled(compute: float, every_step: float, sync: float, overlap: int) -> dict:
    """A sync step's modelled seconds (link_report.py's step, for one step that syncs):
    C + X_e + X_s without overlap; with an overlap of k steps max(C, X_e) + max(0, X_s -
    k C) (the sync's exchange hidden behind the compute of the k steps after it), else
    max(C, X_e + X_s)."""
    hidden = (max(compute, every_step) + max(0.0, sync - overlap * compute) if overlap
              else max(compute, every_step + sync))
    return {"no_overlap": compute + every_step + sync, "overlap": hidden}


def ratio(measured: float | None, modelled: float | None) -> float | None:
    return measured / modelled if measured is not None and modelled else None


def within(value: float | None, tolerance: float) -> str:
    """"ok", "off" (beyond the tolerance) or "–" (not measured)."""
    if value is None:
        return "–"
    return "ok" if abs(value - 1.0) <= tolerance else "off"


def modelled_figures(summary: dict, link: link_model.Link, overlap: int) -> dict:
    """The modelled figures of `link` from an (unshaped) job's summary.json: the averaged
    step with and without overlap, the exchange, the compute, and per scheduled occasion
    (summary.json's link_model.syncs) its exchange X_o and its step (sync_modelled)."""
    report = summary["link_model"]
    figures = report["links"][link.tag]
    compute, exchange = report["compute_seconds"], figures["exchange_seconds"]
    out = {"compute": compute, "exchange": exchange,
           "exchange_slowest_step": figures["exchange_seconds_slowest_step"],
           "step_no_overlap": figures["step_seconds_no_overlap"],
           "step_overlap": figures["step_seconds_overlap"]}
    syncs = report["syncs"]
    if compute is None or not syncs:
        return out
    one = {name: one_exchange(sync, link) for name, sync in syncs.items()}
    every_step = max(exchange - sum(sync["occurrences"] * one[name]
                                    for name, sync in syncs.items()) / report["steps"], 0.0)
    out.update({"every_step_exchange": every_step, "syncs": {
        name: {"occurrences": sync["occurrences"], "exchange": one[name],
               "step": sync_modelled(compute, every_step, one[name],
                                     overlap if is_sync(name) else 0)}
        for name, sync in syncs.items()}})
    return out


def one_exchange(sync: dict, link: link_model.Link) -> float:
    """link_model.py's exchange of one occurrence of a scheduled occasion (its busiest
    device's bytes and messages at `link`; imports aggregation/base.py: TensorFlow)."""
    device = {"d": {"sent": sync["bytes_per_device"], "received": sync["bytes_per_device"]}}
    messages = {"d": {"sent": sync["messages_per_device"],
                      "received": sync["messages_per_device"]}}
    return link_model.exchange_seconds(link_model.traffic_of(device, messages), link)


def modelled_step(traffic: dict, compute: float, link: link_model.Link, rule: SyncRule,
                  groups: dict[str, dict]) -> dict:
    """The step the method claims at `link`, composed from a run's traffic (summary.json's
    link_model: the busiest device's bytes and messages per step, and per scheduled
    occasion) as link_report.py composes it: without overlap C + X; with an overlap of k
    steps (1/S) [sum_o n_o (max(C, X_e) + max(0, X_o - k C)) + (S - sum_o n_o) max(C, X_e)],
    X_e the per-step rest (max(X - sum_o n_o X_o / S, 0)). And the sync step, the sync
    occasions' sync_modelled weighted by the measured `groups`' steps (None without)."""
    exchange = one_exchange(traffic, link)
    syncs, steps = traffic.get("syncs") or {}, traffic["steps"]
    one = {name: one_exchange(sync, link) for name, sync in syncs.items()}
    every_step = max(exchange - sum(sync["occurrences"] * one[name]
                                    for name, sync in syncs.items()) / steps, 0.0)
    kind = "overlap" if rule.overlap else "no_overlap"
    per_sync = {name: sync_modelled(compute, every_step, one[name],
                                    rule.overlap if is_sync(name) else 0)
                for name in syncs}
    if rule.overlap:
        synced = sum(sync["occurrences"] for sync in syncs.values())
        step = (sum(syncs[name]["occurrences"] * per_sync[name]["overlap"] for name in syncs)
                + (steps - synced) * max(compute, every_step)) / steps
    else:
        step = compute + exchange
    sync = composed({name: figures[kind] for name, figures in per_sync.items()}, groups,
                    is_sync)
    return {"step": step, "sync": sync}


def calibrate(rows: list[dict], rules: dict[str, SyncRule], tolerance: float) -> dict | None:
    """Fits link_calibration's calibration on every usable row, and per worker count on the
    others' rows (held out); adds to each row its calibrated step and sync step
    (modelled_step at the calibrated link of its bandwidth) and their ratios, the held-out
    ratio (`calibrated_within` its verdict) and, for a method that claims an overlap, the
    ratio to its calibrated step without it (`calibrated_no_overlap_ratio`). Returns {"all": ..., "held_out": {count: ...},
    "links": {bandwidth: the calibrated --link}} (None: too few usable rows)."""
    try:
        overall = link_calibration.fit(rows)
    except ValueError:
        return None
    held = link_calibration.held_out(rows)
    for row in rows:
        if not link_calibration.usable(row):
            continue
        compute, traffic = row["modelled"]["compute"], row["shaped_link_model"]
        bandwidth = link_calibration.rate(row["bandwidth"])
        rule, groups = rules[row["spec"]], row["groups"]
        fitted = modelled_step(traffic, compute, overall.link(bandwidth), rule, groups)
        row.update(calibrated=fitted["step"], calibrated_ratio=ratio(row["step"], fitted["step"]),
                   calibrated_sync=fitted["sync"],
                   calibrated_sync_ratio=ratio(row["sync_step"], fitted["sync"]))
        if rule.overlap:  # what the step would be if the overlap bought nothing
            plain = modelled_step(traffic, compute, overall.link(bandwidth),
                                  dataclasses.replace(rule, overlap=0), groups)
            row["calibrated_no_overlap_ratio"] = ratio(row["step"], plain["step"])
        if row["workers"] in held:
            unseen = modelled_step(traffic, compute, held[row["workers"]].link(bandwidth),
                                   rule, groups)
            row["held_out_ratio"] = ratio(row["step"], unseen["step"])
        row["calibrated_within"] = within(row.get("held_out_ratio"), tolerance)
        row["calibrated_ms"] = fitted["step"] * SECONDS
    links = sorted({row["bandwidth"] for row in rows}, key=link_calibration.rate)
    return {"all": overall.as_dict(), "described": overall.describe(),
            "held_out": {count: calibration.as_dict() for count, calibration in held.items()},
            "links": {b: "between:" + overall.link(link_calibration.rate(b)).name
                      for b in links}}


def cell_row(label: str, spec: str, workers: int, bandwidth: str, rule: SyncRule,
             unshaped: dict, shaped: dict, modelled: dict, tolerance: float) -> dict:
    """One table row (ms) and its JSON (seconds): `unshaped`, `shaped` the jobs' records
    (their summaries and per-step times), `modelled` modelled_figures'. The sync step,
    measured and modelled, is composed over the sync occasions by their timed steps."""
    groups = group_medians(shaped.get("step_times") or {}, rule)
    step = composed(medians(groups), groups)
    claimed = modelled.get("step_overlap" if rule.overlap else "step_no_overlap")
    kind = "overlap" if rule.overlap else "no_overlap"
    sync = composed(medians(groups), groups, is_sync)
    sync_models = {way: composed({name: figures["step"][way] for name, figures
                                  in modelled.get("syncs", {}).items()}, groups, is_sync)
                   for way in ("no_overlap", "overlap")}
    sync_model = sync_models[kind]
    summary = shaped.get("summary") or {}
    row = {"method": label, "spec": spec, "workers": workers, "bandwidth": bandwidth,
           "unshaped_step": (unshaped.get("summary") or {}).get("median_step_time"),
           "median_step": summary.get("median_step_time"), "sync_step": sync,
           "merge_step": composed(medians(groups), groups, lambda n: n.endswith(" merge")),
           "step": step, "modelled_no_overlap": modelled.get("step_no_overlap"),
           "modelled_overlap": modelled.get("step_overlap"),
           "claims_overlap": bool(rule.overlap), "ratio": ratio(step, claimed),
           "sync_modelled": sync_model, "sync_ratio": ratio(sync, sync_model),
           "sync_modelled_no_overlap": sync_models["no_overlap"],
           "sync_modelled_overlap": sync_models["overlap"],
           "exchange_alone": summary.get("exchange_seconds"),
           "modelled_exchange": modelled.get("exchange"), "groups": groups,
           "modelled": modelled}
    row["within"] = within(row["ratio"], tolerance)
    row["sync_within"] = within(row["sync_ratio"], tolerance)
    for key in ("unshaped_step", "median_step", "sync_step", "merge_step", "step",
                "modelled_no_overlap", "modelled_overlap", "sync_modelled"):
        row[f"{key}_ms"] = None if row[key] is None else row[key] * SECONDS
    return row


COLUMNS = [("method", "method", ""), ("workers", "workers", "d"), ("bandwidth", "link", ""),
           ("unshaped_step_ms", "unshaped ms", ".2f"), ("median_step_ms", "median step", ".2f"),
           ("sync_step_ms", "sync step", ".2f"), ("merge_step_ms", "merge step", ".2f"),
           ("step_ms", "step", ".2f"), ("modelled_no_overlap_ms", "modelled", ".2f"),
           ("modelled_overlap_ms", "modelled, overlap", ".2f"), ("ratio", "ratio", ".2f"),
           ("within", "≤ 15%", ""), ("sync_modelled_ms", "sync modelled", ".2f"),
           ("sync_ratio", "sync ratio", ".2f"), ("calibrated_ms", "calibrated", ".2f"),
           ("calibrated_ratio", "ratio", ".2f"), ("held_out_ratio", "held out", ".2f"),
           ("calibrated_within", "≤ 15%", ""), ("calibrated_sync_ratio", "sync ratio", ".2f"),
           ("calibrated_no_overlap_ratio", "ratio without the overlap", ".2f")]


# --- the jobs --------------------------------------------------------------------------------

def train_flags(spec: str, logdir: str, links: list[str]) -> list[str]:
    """The train flags of one job (after the launcher's `--`)."""
    return [f"--model={FLAGS.model}", f"--aggregation={spec}", f"--train_steps={FLAGS.steps}",
            f"--global_batch_size={FLAGS.global_batch}", "--steps_per_loop=1",
            "--summary_every=1", "--log_every=0", "--checkpoint_every=0",
            f"--time_exchange={str(FLAGS.exchange_alone).lower()}", f"--logdir={logdir}",
            f"--link=within:{WITHIN}", *[f"--link=between:{link}" for link in links],
            *FLAGS.train_flag]


def run_job(workers: int, netns: bool, train: list[str], folder: str,
            devices_per_worker: str, timeout: float) -> dict:
    """One launch to its end (or `timeout` seconds: SIGINT, then a second): its command,
    exit code, wall seconds, the chief's summary.json and per-step times, and what of its
    launcher's names is left behind."""
    command = [sys.executable, "-m", "mgloop.launch", f"--num_workers={workers}",
               f"--devices_per_worker={devices_per_worker}",
               *(["--netns"] if netns else []), "--", *train]
    os.makedirs(folder, exist_ok=True)
    log_path = os.path.join(folder, "launch.log")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    began = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            code = process.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as stop:
            code = stop_launcher(process)
            if isinstance(stop, KeyboardInterrupt):
                raise
    seconds = time.monotonic() - began
    logdir = train[[f.startswith("--logdir=") for f in train].index(True)].split("=", 1)[1]
    summary_path = os.path.join(logdir, "summary.json")
    summary = None
    if code == 0 and os.path.exists(summary_path):
        with open(summary_path) as handle:
            summary = json.load(handle)
    return {"command": command, "exit_code": code, "seconds": seconds, "log": log_path,
            "logdir": logdir, "summary": summary,
            "step_times": step_times(os.path.join(logdir, "train")) if summary else None,
            "left_behind": left_behind(process.pid) if netns else []}


def stop_launcher(process: subprocess.Popen) -> int:
    """SIGINT to the launcher (it stops its workers and removes its namespaces), a second
    after 60 s (its workers are killed), then its exit code."""
    for _ in range(2):
        process.send_signal(signal.SIGINT)
        try:
            return process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            continue
    return process.wait()


def left_behind(launcher_pid: int) -> list[str]:
    """What `ip netns list` and `ip link` still show of the launcher `launcher_pid`'s names
    (netns.py's: namespaces mgl<pid>-..., links mgl<pid>br, mgl<pid>h<i>, mgl<pid>w<i>)."""
    shown = "".join(subprocess.run(["ip", *what], capture_output=True, text=True).stdout
                    for what in (("netns", "list"), ("link",)))
    names = re.compile(rf"\bmgl{launcher_pid}(?:-\w+|br|[hw]\d+)\b")
    return sorted({match.group(0) for line in shown.splitlines()
                   for match in [names.search(line)] if match})


def step_times(folder: str) -> dict[int, float]:
    """{TensorBoard step g: train/step_time} from the chief's event files in `folder`: with
    one step per loop and a summary each, the seconds of step s = g - 1."""
    import tensorflow as tf
    from tensorflow.core.util import event_pb2
    out = {}
    for name in sorted(os.listdir(folder)):
        if not name.startswith("events"):
            continue
        for record in tf.data.TFRecordDataset(os.path.join(folder, name)):
            event = event_pb2.Event.FromString(record.numpy())
            for value in event.summary.value:
                if value.tag == "step_time":
                    out[int(event.step)] = float(tf.make_ndarray(value.tensor))
    return out


def checked(summary: dict | None, rule: SyncRule, steps: int) -> str | None:
    """A line when the steps of each scheduled occasion by `rule` over g = 1..steps differ
    from the occurrences the run counted (summary.json's link_model.syncs), else None."""
    if summary is None:
        return None
    counted = {name: sync["occurrences"]
               for name, sync in summary["link_model"]["syncs"].items() if sync["occurrences"]}
    ruled: dict[str, int] = {}
    for name in map(rule.group, range(1, steps + 1)):
        if name != "other" and not name.endswith(" merge"):  # merges send nothing
            ruled[name] = ruled.get(name, 0) + 1
    return (None if counted == ruled else
            f"the steps of each occasion by this script's rule, {ruled}, are not those the "
            f"run counted, {counted}: the sync and merge columns are wrong")


def refusal(workers: list[int], bandwidths: list[str]) -> str | None:
    """The one line that refuses the measurement here (netns.py's refusal), or None."""
    for bandwidth in bandwidths:
        try:
            link = link_model.parse(f"between:{bandwidth},{FLAGS.latency}")
        except Exception as error:  # ConfigError: one line
            return str(error)
        shaping = netns_lib.Shaping(link.bytes_per_second * 8, link.latency_seconds)
        problem = netns_lib.refusal(max(workers), shaping)
        if problem:
            return problem
    return None


def retable(path: str) -> int:
    """--from_json: the table and calibration of an earlier run's JSON, no job run."""
    try:
        with open(path) as handle:
            payload = json.load(handle)
        rows, settings = payload["rows"], payload["settings"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"link_check: error: --from_json={path} is not a link_check JSON with rows and "
              f"settings ({type(error).__name__}: {error})", file=sys.stderr)
        return 2
    calibration = calibrate(rows, {row["spec"]: sync_rule(row["spec"]) for row in rows},
                            settings.get("tolerance", FLAGS.tolerance))
    header = (f"from {path} (made by: {payload['command']}); {settings['model']}, global batch "
              f"{settings['global_batch']}, {settings['steps']} steps; latency modelled: "
              f"{settings['latency']}; times in ms")
    benchlib.publish(header, rows, COLUMNS, FLAGS.json_out,
                     settings=dict(settings, calibration=calibration, from_json=path))
    print_calibration(calibration)
    return 0


def print_calibration(calibration: dict | None) -> None:
    """The calibration's lines under the table."""
    if calibration is None:
        print("calibration: too few cells with a measured step")
        return
    print(f"calibration (link_calibration.py): {calibration['described']}; calibrated links: "
          + ", ".join(f"{b} -> --link={link}" for b, link in calibration["links"].items()))
    for count, held in calibration["held_out"].items():
        fitted = link_calibration.Calibration(**held)
        print(f"held out: the {count}-worker cells modelled with the calibration of the "
              f"others: {fitted.describe()}")


def main(argv):
    del argv
    if FLAGS.from_json:
        return retable(FLAGS.from_json)
    unknown = [label for label in FLAGS.methods if label not in METHODS]
    if unknown:
        raise app.UsageError(f"--methods: {', '.join(unknown)} not among {', '.join(METHODS)}; "
                             "give other specs with --method=SPEC")
    methods = [(label, METHODS[label]) for label in FLAGS.methods] + [
        (spec, spec) for spec in FLAGS.method]
    workers = [int(count) for count in FLAGS.workers]
    bandwidths = list(FLAGS.bandwidths)
    problem = refusal(workers, bandwidths)
    if problem:
        print(f"link_check: error: {problem}", file=sys.stderr)
        return 2
    links = {bandwidth: link_model.parse(f"between:{bandwidth},{FLAGS.latency}")
             for bandwidth in bandwidths}
    rules = {spec: sync_rule(spec) for _, spec in methods}
    output = FLAGS.output_dir or tempfile.mkdtemp(prefix="link_check-")
    rows, jobs, began = [], [], time.monotonic()
    for label, spec in methods:
        for count in workers:
            name = f"{label}-w{count}".replace(":", "_").replace(",", "_").replace("=", "")
            folder = os.path.join(output, name, "unshaped")
            unshaped = run_job(count, False, train_flags(
                spec, os.path.join(folder, "logdir"),
                [link.name for link in links.values()]), folder, FLAGS.devices_per_worker,
                FLAGS.timeout)
            print(f"{label}, {count} workers, unshaped: exit {unshaped['exit_code']}, "
                  f"{unshaped['seconds']:.0f} s", flush=True)
            jobs.append(unshaped)
            for bandwidth, link in links.items():
                folder = os.path.join(output, name, bandwidth)
                shaped = run_job(count, True, train_flags(
                    spec, os.path.join(folder, "logdir"), [link.name]), folder,
                    FLAGS.devices_per_worker, FLAGS.timeout)
                print(f"{label}, {count} workers, {bandwidth}: exit {shaped['exit_code']}, "
                      f"{shaped['seconds']:.0f} s", flush=True)
                jobs.append(shaped)
                rows.append(cell(label, spec, count, bandwidth, link, rules[spec], unshaped,
                                 shaped))
    notes = [f"{row['method']}, {row['workers']} workers, {row['bandwidth']}: {problem}"
             for row in rows for problem in row["problems"]]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left = [name for job in jobs for name in job["left_behind"]]
    minutes = (time.monotonic() - began) / 60
    calibration = calibrate(rows, rules, FLAGS.tolerance)
    header = (f"{FLAGS.model}, global batch {FLAGS.global_batch}, {FLAGS.steps} steps, one "
              f"device per worker; links shaped by tbf (latency modelled: {FLAGS.latency}); "
              f"{len(jobs)} jobs in {minutes:.1f} min; times in ms")
    benchlib.publish(header, rows, COLUMNS, FLAGS.json_out, settings={
        "methods": dict(methods), "workers": workers, "bandwidths": bandwidths,
        "latency": FLAGS.latency, "steps": FLAGS.steps, "global_batch": FLAGS.global_batch,
        "model": FLAGS.model, "devices_per_worker": FLAGS.devices_per_worker,
        "train_flags": FLAGS.train_flag, "tolerance": FLAGS.tolerance,
        "output_dir": output, "minutes": minutes, "netns_left": left,
        "ip_netns_list_after": listed, "calibration": calibration})
    print_calibration(calibration)
    for note in notes:
        print(f"note: {note}")
    print("namespaces left by these jobs: " + (", ".join(left) if left else "none")
          + f" (`ip netns list`: {len(listed.splitlines())} namespace(s) on the machine)")
    return 1 if notes else 0


def cell(label: str, spec: str, workers: int, bandwidth: str, link: link_model.Link,
         rule: SyncRule, unshaped: dict, shaped: dict) -> dict:
    """The row of one cell from its two jobs, with what went wrong in `problems`."""
    modelled = (modelled_figures(unshaped["summary"], link, rule.overlap)
                if unshaped["summary"] else {})
    row = cell_row(label, spec, workers, bandwidth, rule, unshaped, shaped, modelled,
                   FLAGS.tolerance)
    problems = [f"{kind} job exit code {job['exit_code']} ({job['log']})"
                for kind, job in (("unshaped", unshaped), ("shaped", shaped))
                if job["exit_code"] != 0]
    if shaped["left_behind"]:
        problems.append(f"namespaces left: {', '.join(shaped['left_behind'])}")
    mismatch = checked(unshaped["summary"], rule, FLAGS.steps)
    if mismatch:
        problems.append(mismatch)
    row.update(problems=problems, unshaped_job=without_summary(unshaped),
               shaped_job=without_summary(shaped),
               shaped_link_model=(shaped["summary"] or {}).get("link_model"))
    return row


def without_summary(job: dict) -> dict:
    """A job's record for the JSON: all but its summary (its figures are in the row)."""
    return {key: value for key, value in job.items() if key != "summary"}


if __name__ == "__main__":
    define_flags()
    app.run(main)
