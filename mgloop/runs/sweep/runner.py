"""Runs a plan's cells: one build in memory at a time, resumable, on one or more processes.

A cell runs `mgloop.run` on its Config in its own logdir, then writes its record
(record.py) to <output_dir>/results/<cell folder>.json, atomically, as soon as it ends.
A re-run of the same sweep skips every cell whose record exists; a cell that was
interrupted (no record) is started again from step 0 in a fresh logdir (its old one is
removed first, since a half-run's checkpoint would resume it with a history that lacks
the first evals).

Memory. Each process holds one cell's build at a time: once a cell's record is
written, its RunResult (the trainer, every variable copy, the traced steps) is dropped,
Keras' global state cleared (`keras.backend.clear_session`) and the garbage collected
before the next cell builds (no Trainer outlives its cell: tests/test_sweep.py). What
TensorFlow itself keeps of a finished cell is not: about 150 MB per cell of the mlp on 4
nodes with top-k (RSS after each of 4 cells in one process, /tmp probe of the runner), its
tf.data and loop functions (AtomicFunction, FuncGraph) held from TensorFlow's C++ side
(objgraph finds no chain to them from any Python module), so a process that runs many
cells grows. That is bounded by running every `cells_per_process` cells in a fresh
spawned process (runner.run_in_processes; default 4 from the command line), which also
costs that process TensorFlow's start and its first trace.
With `processes` = 1 and cells_per_process = 0 the cells run in this process; otherwise
chunks of cells_per_process cells each run in a fresh process, `processes` at a time
(each configures the logical CPUs of the largest cell once). Python 3.11's
ProcessPoolExecutor with max_tasks_per_child hung here after its first replacement
worker (a 36-cell sweep stopped at 17 records), hence plain processes.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import shutil

from absl import logging

from mgloop.runs.sweep import plan as plan_lib
from mgloop.runs.sweep import record as record_lib


def pending(plan: plan_lib.Plan, cells) -> list:
    """The cells without a record, in plan order."""
    return [cell for cell in cells if not os.path.exists(plan.result_path(cell))]


def run_cell(plan: plan_lib.Plan, cell) -> str | None:
    """Runs one cell from scratch and writes its record; returns the record's path (None:
    the cell was stopped by a signal, left without a record for the re-run).

    A cell whose loss became NaN or infinite (failures.NonFinite) is a result, not an
    error: its record holds the evals made before (`record.diverged_record`)."""
    import keras
    import mgloop
    from mgloop.runs import callbacks as callbacks_lib
    from mgloop.runs import failures
    logdir = plan.logdir(cell)
    if os.path.exists(logdir):
        shutil.rmtree(logdir)
    config = plan.config(cell)
    history = callbacks_lib.History()  # its evals, kept if the cell diverges (no RunResult)
    callbacks = [history]
    if plan.stop_at_target and plan.target:
        callbacks.append(_stop_at(plan.target))
    logging.info("sweep: cell %s (%d steps, eval every %d)", cell.name, config.train_steps,
                 config.eval_every)
    try:
        result = mgloop.run(config, callbacks=callbacks)
    except failures.NonFinite as error:
        record = record_lib.diverged_record(cell, history, str(error), plan.target)
        logging.warning("sweep: cell %s diverged: %s", cell.name, error)
    else:
        if result.summary.get("preempted"):
            return None
        record = record_lib.record_of(cell, result, plan.target)
        del result
    path = plan.result_path(cell)
    record_lib.write(path, record)
    keras.backend.clear_session()
    gc.collect()
    return path


def _stop_at(target):
    def reached(step, metrics):
        return target.met(metrics.get(target.key))
    reached.__name__ = f"target {target}"
    return reached


def _run_chunk(plan: plan_lib.Plan, cells, towers: int) -> None:
    """A process's cells one after the other, on the logical CPUs of the largest cell
    (configured once per process; absl logs at INFO)."""
    from mgloop.cluster import devices
    logging.set_verbosity(logging.INFO)
    devices.configure_logical_cpus(towers)
    for cell in cells:
        if run_cell(plan, cell) is None:
            return  # stopped by a signal: the rest of the chunk waits for the re-run


def chunks(cells: list, size: int) -> list[list]:
    """`cells` in consecutive runs of `size` (all in one for size 0)."""
    size = size or max(1, len(cells))
    return [cells[i:i + size] for i in range(0, len(cells), size)]


def run_in_processes(plan: plan_lib.Plan, todo: list, towers: int, processes: int,
                     cells_per_process: int) -> None:
    """Each chunk of `cells_per_process` cells in a fresh spawned process, `processes` at
    a time. A process that fails does not stop the others: once every chunk has run, the
    cells left without a record are named in one error (the re-run runs just those)."""
    context = multiprocessing.get_context("spawn")
    waiting = chunks(todo, cells_per_process)
    running: list = []
    failed: list[int] = []
    while waiting or running:
        while waiting and len(running) < max(1, processes):
            process = context.Process(target=_run_chunk, args=(plan, waiting.pop(0), towers))
            process.start()
            running.append(process)
        running[0].join(timeout=1.0)
        for process in [p for p in running if p.exitcode is not None]:
            running.remove(process)
            if process.exitcode != 0:
                failed.append(process.exitcode)
    missing = [c.name for c in todo if not os.path.exists(plan.result_path(c))]
    if missing:
        raise RuntimeError(f"{len(missing)} cells have no record (sweep processes ended with "
                           f"exit codes {failed or 'none'}; their logs above say why): "
                           f"{', '.join(missing)}; re-run the same command to run them")


def run(plan: plan_lib.Plan, processes: int = 1, cells_per_process: int = 0) -> list[str]:
    """Validates every cell, then runs the pending ones; returns every cell's record path."""
    cells = plan.cells()
    configs = [plan.config(cell) for cell in cells]  # every cell checked before any runs
    todo = pending(plan, cells)
    logging.info("sweep: %d cells, %d done before, %d to run on %d process(es)",
                 len(cells), len(cells) - len(todo), len(todo), processes)
    towers = plan_lib.towers_needed(configs)
    if processes <= 1 and not cells_per_process:
        _run_chunk(plan, todo, towers)
    elif todo:
        run_in_processes(plan, todo, towers, processes, cells_per_process)
    return [plan.result_path(cell) for cell in cells]
