"""Runs a plan's cells: one build in memory at a time, resumable, stoppable by a signal,
on one or more processes.

A cell runs `mgloop.run` on its Config in its own logdir, then writes its record
(record.py) to <output_dir>/results/<cell folder>.json, atomically, as soon as it ends.
A re-run of the same sweep skips every cell whose record exists (saying nothing per
cell) and resumes a cell that was stopped from its checkpoint: its evals before the stop
are kept in its logdir (kept_evals.py), so its record equals that of a cell never
stopped. A cell with no checkpoint yet starts again from step 0 in a fresh logdir.
With --tune (tune.py, search.py) each variant's tuning cells run first, then its final cells
at its chosen point, chosen from its tuning records (a variant whose search has chosen runs
its final seeds beside the others' tuning): a re-run skips the finished tuning cells and
chooses the same; one whose search tries more points (a wider
--tune_widen) updates the tuning summary of a final record whose choice holds, and refuses,
naming what to remove, one whose choice moved.

Stopping. SIGINT or SIGTERM stops the cell running at its next loop boundary, with a
checkpoint of that step (preemption.py, as `mgloop.train`), and no further cell starts;
`run` then raises `Stopped` (the entry point prints its one line and exits with 128 +
the signal number). The sweep's StopOnSignal spans all the cells of a process, so a
signal that arrives between two cells or in the last loop of one is not lost; the cells'
runs, nested in it, report nothing about the stop. A second signal ends the process at
once, leaving the last checkpoint and removing the logdir lock. With worker processes
the parent forwards the signals to them and waits for them (processes.py).

Memory. Each process holds one cell's build at a time: once a cell's record is
written, its RunResult (the trainer, every variable copy, the traced steps) is dropped,
Keras' global state cleared (`keras.backend.clear_session`) and the garbage collected
before the next cell builds (no Trainer outlives its cell: tests/test_sweep.py). What
TensorFlow itself keeps of a finished cell is not: about 150 MB per cell of the mlp on 4
nodes with top-k (RSS after each of 4 cells in one process), its tf.data and loop
functions held from TensorFlow's C++ side, so a process that runs many cells grows. That
is bounded by running every `cells_per_process` cells in a fresh spawned process
(processes.py; default 4 from the command line). With `processes` = 1 and
cells_per_process = 0 the cells run in this process.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging as std_logging
import os
import shutil
import signal
from typing import Callable

from absl import logging

from mgloop.runs.sweep import kept_evals
from mgloop.runs.sweep import plan as plan_lib
from mgloop.runs.sweep import record as record_lib
from mgloop.runs.sweep import search
from mgloop.runs.sweep import tune


class Stopped(Exception):
    """The sweep was stopped by a signal; the message is one line saying where, and how to
    resume."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


@dataclasses.dataclass(frozen=True)
class _Resumed:
    """What record.record_of reads of a RunResult, with the evals of all the cell's attempts
    (kept_evals.py) as its history."""

    summary: dict
    history: object
    trainer: object  # its aggregation's traffic: what each step sends


def pending(plan: plan_lib.Plan, cells) -> list:
    """The cells without a record, in plan order."""
    return [cell for cell in cells if not os.path.exists(plan.result_path(cell))]


def _prepare_logdir(logdir: str) -> None:
    """Resumable (a checkpoint): drops kept evals past its newest checkpoint; else starts
    the logdir afresh (what an attempt without a checkpoint left is removed)."""
    from mgloop.runs import checkpoint_files
    steps = checkpoint_files.checkpoint_steps(os.path.join(logdir, "checkpoints"))
    if steps:
        kept_evals.truncate(logdir, steps[0])
    elif os.path.exists(logdir):
        shutil.rmtree(logdir)


def run_cell(plan: plan_lib.Plan, cell) -> str | None:
    """Runs one cell (resumed from its checkpoint, if any) and writes its record; returns
    the record's path (None: the cell was stopped by a signal, left with its checkpoint
    for the re-run).

    A cell whose loss became NaN or infinite (failures.NonFinite) is a result, not an
    error: its record holds the evals made before (`record.diverged_record`)."""
    import keras
    import mgloop
    from mgloop.runs import failures
    logdir = plan.logdir(cell)
    _prepare_logdir(logdir)
    config = plan.config(cell)
    callbacks = [kept_evals.Keeper(logdir)]
    if plan.stop_at_target and plan.target and not cell.tuning:  # tuning: the whole budget
        callbacks.append(_stop_at(plan.target))
    logging.info("sweep: cell %s (%d steps, eval every %d)", cell.name, config.train_steps,
                 config.eval_every)
    try:
        result = mgloop.run(config, callbacks=callbacks)
    except failures.NonFinite as error:
        record = record_lib.diverged_record(cell, kept_evals.history(logdir), str(error),
                                            plan.target)
        logging.warning("sweep: cell %s diverged: %s", cell.name, error)
    else:
        if result.summary.get("preempted"):
            return None
        whole = _Resumed(result.summary, kept_evals.history(logdir), result.trainer)
        record = record_lib.record_of(cell, whole, plan.target)
        del result, whole
    _add_tuning(plan, cell, record)
    path = plan.result_path(cell)
    record_lib.write(path, record)
    keras.backend.clear_session()
    gc.collect()
    return path


def _add_tuning(plan: plan_lib.Plan, cell, record: dict) -> None:
    """A tuning cell's record: its point's place in the variant's grid; a final cell's:
    its variant's tuning (search.summary_for: what was tried, the scores, the choice)."""
    if cell.tuning:
        record["tune_index"] = search.order_of(plan, cell.variant).index(cell.point)
        record["tune_search"] = search.searched(plan)
    elif plan.tune:
        record["tuning"] = search.summary_for(plan, cell.variant)


def _stop_at(target):
    def reached(step, metrics):
        return target.met(metrics.get(target.key))
    reached.__name__ = f"target {target}"
    return reached


class _NoCrossCellRetracing(std_logging.Filter):
    """Drops TensorFlow's "N out of the last M calls to <function ...> triggered
    tf.function retracing": it counts the traces of every tf.function made from one piece
    of code, so the summary writers each cell makes anew add up over a process's cells to
    a warning that a single run (`mgloop.train`) never gives."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return "triggered tf.function retracing" not in record.getMessage()


def run_chunk(plan: plan_lib.Plan, cells, towers: int, stop) -> None:
    """A process's cells one after the other, on the logical CPUs of the largest cell
    (configured once per process; absl logs at INFO), until `stop` (the sweep's
    StopOnSignal) has seen a signal."""
    from mgloop.cluster import devices
    logging.set_verbosity(logging.INFO)
    devices.configure_logical_cpus(towers)
    quiet = _NoCrossCellRetracing()
    std_logging.getLogger("tensorflow").addFilter(quiet)
    try:
        for cell in cells:
            if stop.requested or run_cell(plan, cell) is None:
                return  # stopped by a signal: the rest waits for the re-run
    finally:
        std_logging.getLogger("tensorflow").removeFilter(quiet)


def stopped_message(plan: plan_lib.Plan, cells, signum: int, at_once: bool) -> str:
    """The one line that says where a stopped sweep stopped and how to resume."""
    name = signal.Signals(signum).name
    done = len(cells) - len(pending(plan, cells))
    saved = []
    for cell in pending(plan, cells):
        try:
            with open(os.path.join(plan.logdir(cell), "summary.json")) as handle:
                summary = json.load(handle)
        except (OSError, ValueError):
            continue
        if summary.get("preempted"):
            saved.append(f"cell {cell.name} saved at step {summary['preempted']['step']} of "
                         f"{summary['config']['train_steps']}")
    how = "at once by a second" if at_once else "by"
    return (f"stopped {how} {name}: {done} of {len(cells)} cells done"
            + "".join(f", {text}" for text in saved)
            + "; run the same command to resume")


def _check_resumable(plan: plan_lib.Plan, cells, configs) -> None:
    """A stopped cell resumes only with the settings of its checkpoints (run_dir)."""
    from mgloop.errors import ConfigError
    from mgloop.runs import run_dir
    todo = pending(plan, cells)
    for cell, config in zip(cells, configs):
        if cell in todo:
            try:
                run_dir.check_resumable(config.validated(on_disk=False))
            except ConfigError as error:
                raise ConfigError(f"cell {cell.name}: {error} (or remove that folder to run "
                                  "the cell from step 0)") from None


def _reconcile_finals(plan: plan_lib.Plan, cells, summaries: dict) -> None:
    """Final records from before the search tried more points (a wider --tune_widen): at
    the same choice, the record's `tuning` summary ({variant name: search.summary_for})
    is brought up to date (its training result untouched); at a moved one, ConfigError
    naming what to remove, so that no final seed stands for a point no longer chosen."""
    from mgloop.errors import ConfigError
    for cell in cells:
        path = plan.result_path(cell)
        if not cell.point or not os.path.exists(path):
            continue
        record = record_lib.read(path)
        trained = record.get("tuned") or {}
        if trained != dict(cell.point):  # said in the point's key order (records sort keys)
            ordered = [(k, trained[k]) for k, _ in cell.point if k in trained]
            raise ConfigError(
                f"cell {cell.name}: its record {path} was trained at "
                f"{tune.text_of(ordered + sorted(trained.items() - set(ordered)))}, but the "
                f"search now chooses {tune.text_of(cell.point)}; remove it and "
                f"{plan.logdir(cell)} to run that seed at the new choice")
        summary = json.loads(json.dumps(summaries[cell.variant.name]))  # as a record reads
        if record.get("tuning") != summary:
            record["tuning"] = summary
            record_lib.write(path, record)
            logging.info("sweep: cell %s: its tuning summary brought up to date (the same "
                         "choice)", cell.name)


def _finals(plan: plan_lib.Plan, among) -> list:
    """The final cells of the variants `among` at their chosen points, their records
    reconciled and checkpoints checked."""
    chosen = {v.name: search.chosen_point(plan, v) for v in among}
    cells = [cell for cell in plan.cells(chosen) if cell.variant.name in chosen]
    _reconcile_finals(plan, cells, {v.name: search.summary_for(plan, v) for v in among})
    _check_resumable(plan, cells, [plan.config(cell) for cell in cells])
    return cells


def _say_edges(plan: plan_lib.Plan, variants) -> None:
    """Warns of each variant whose chosen point lies at its grid's edge."""
    for variant in variants:
        edges = (search.summary_for(plan, variant) or {}).get("at_edge") or {}
        if sides := ", ".join(f"{side} {key}" for key, side in edges.items()):
            logging.warning("sweep: variant %s's chosen %s lies at the grid's %s: the best "
                            "may be outside it; widen --tune on that side", variant.name,
                            tune.text_of(search.chosen_point(plan, variant)), sides)


def run(plan: plan_lib.Plan, processes: int = 1, cells_per_process: int = 0,
        last_words: Callable[[str], None] | None = None) -> list[str]:
    """Validates every cell (a stopped one also against the settings of its checkpoints:
    run_dir.check_resumable), then runs the pending ones; returns every final cell's record
    path. In rounds: each the points every variant's search needs next (the whole grid, a
    line of one axis, a widened value: search.next_points) and the final cells of each
    variant whose search has chosen, run together, so no process waits for the slowest
    search (the cells of a round checked again once known); chosen points at a grid's
    edge are said at the end. Raises Stopped if a signal stopped the sweep (module
    docstring). With the cells in this process, a second signal ends it at once:
    `last_words(line)` says where first (default: the line is logged as a warning)."""
    from mgloop.runs import preemption
    from mgloop.runs.sweep import processes as processes_lib
    tuning = plan.tuning_cells()
    variants = plan.variants()
    firsts = {v.name: plan.tune_points(v)[0] for v in variants}
    finals = plan.cells(firsts)  # each variant at its first point: checked with the rest
    everything = tuning + finals
    configs = [plan.config(cell) for cell in everything]  # every cell checked before any runs
    _check_resumable(plan, tuning, configs[:len(tuning)])
    todo = pending(plan, everything)
    if plan.tune_search == "grid" and not plan.tune_widen:
        logging.info("sweep: %d cells (%d tuning), %d done before, %d to run on %d "
                     "process(es)", len(everything), len(tuning),
                     len(everything) - len(todo), len(todo), processes)
    else:  # the search decides its cells as it goes: the least it runs, and the grid's
        least = search.least_tuning_cells(plan)
        logging.info("sweep: %d final cells after a %s search of %d tuning cells or more "
                     "(%d in the grid given; each widening adds a point), %d of the grid's "
                     "cells done before, on %d process(es)", len(finals), plan.tune_search,
                     least, len(tuning), len(everything) - len(todo), processes)
    towers = plan_lib.towers_needed(configs)

    def reached():
        """The stop message's count: the grid, any widened point reached, the finals."""
        extra = [cell for v in variants for point in search.order_of(plan, v)
                 for cell in plan.tuning_cells_of(v, point) if cell not in tuning]
        return tuning + extra + finals

    def next_round():  # each variant's next tuning points, or once chosen, its finals
        cells, chosen = [], []
        for variant in variants:
            points = search.next_points(plan, variant)
            cells += [cell for point in points for cell in plan.tuning_cells_of(variant, point)]
            chosen += [] if points else [variant]
        cells = pending(plan, cells)
        _check_resumable(plan, cells, [plan.config(cell) for cell in cells])
        return cells + pending(plan, _finals(plan, chosen))

    signum, at_once = None, False
    if processes <= 1 and not cells_per_process:
        say = last_words or (lambda line: logging.warning("%s", line))
        with preemption.StopOnSignal(announce=False, last_words=lambda signum: say(
                stopped_message(plan, reached(), signum, at_once=True))) as stop:
            while not stop.requested and (cells := next_round()):
                run_chunk(plan, cells, towers, stop)
        signum = stop.signum
    else:
        while signum is None and (cells := next_round()):
            signum, at_once = processes_lib.run(plan, cells, towers, processes,
                                                cells_per_process, run_chunk)
    if signum is not None:
        raise Stopped(stopped_message(plan, reached(), signum, at_once), signum)
    _say_edges(plan, variants)
    return [plan.result_path(cell) for cell in finals]
