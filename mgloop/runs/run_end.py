"""The end of a run (experiment.py): what it measures after training, the summary it
writes to summary.json and returns, and the checkpoint it rescues if its logdir goes.

A run ends one of three ways: trained to --train_steps (`measure`: the exchange timed
alone, the link model, the final scalars and eval; then `trained`, the summary of every
figure); stopped by a signal (`stopped`: where it stopped, no final eval or export, the
resumed run does them); or with nothing left to train (`finished`: summary.json is left
as it is; a summary of a stopped run is not an end: `ended`). `rescue_saver` saves the
checkpoint into another folder when the logdir disappears during the run
(monitor.logdir_guard).

In an elastic job (cluster/elastic.py) each round of workers is one such run; its
summary also holds every round of the job (elastic_summary.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from typing import Callable

from absl import logging

from mgloop.aggregation.local import async_run
from mgloop.observe import link_report, link_scalars
from mgloop.observe import summaries
from mgloop.runs import callbacks as callbacks_lib
from mgloop.runs import checkpoint, controller, elastic_summary, export
from mgloop.runs import monitor as monitor_lib
from mgloop.runs import preemption
from mgloop.runs import step_flops
from mgloop.runs.config import Config
from mgloop.runs.trainer import Trainer
from mgloop.training import metrics as metrics_lib


@dataclasses.dataclass(frozen=True)
class Measured:
    """What a trained run measures once training is done (`measure`)."""

    eval_metrics: dict
    traffic: dict  # bytes per device, averaged over the run's steps (link_report.py)
    messages: dict  # messages per device, averaged alike
    link_report: dict  # link_report.report_of_run
    exchange_seconds: float | None  # the exchange timed alone; None: no step was trained


def rescue_saver(trainer: Trainer, node_saver=None, chief: bool = True) -> Callable[[str], str]:
    """save(folder): the trainer's checkpoint of its current step, saved into
    `<folder>/checkpoints` (keeping one), the chief's; and this worker's node state
    beside it (`node_saver`, node_checkpoint.NodeCheckpoints: every worker saves its
    own node's part); returns the path of the chief's checkpoint, or of the node's."""

    def save_rescue(folder):
        step = int(trainer.global_step.numpy())
        directory = os.path.join(folder, "checkpoints")
        path = node_saver.save_into(directory, step) if node_saver is not None else None
        if chief:
            path = checkpoint.Checkpointer.of_trainer(directory, trainer, keep=1).save(step)
        return path
    return save_rescue


def measure(config: Config, trainer: Trainer, result: controller.FitResult, start_step: int,
            health, monitor: monitor_lib.Monitor, train_writer, eval_writer,
            chief: bool, example_spec=(None, None)) -> Measured:
    """After training: the exchange timed alone (if any step was trained, and
    --time_exchange), then the peers' health checks stop (no collective between workers
    from here on), the compute per step
    of --compute (step_flops.py: traces the step for its FLOPs with a profile, from the
    input's `example_spec`, its (features, labels) specs of one example), the link model,
    the final scalars and the final eval; closes both writers; the chief writes the final
    metrics (HParams) and the compute's source (TensorBoard text)."""
    exchange_seconds = (trainer.time_exchange()
                        if config.time_exchange and result.final_step > start_step else None)
    health.stop()  # no collective between workers from here on: a peer may now exit
    schedule = link_report.Schedule(trainer.aggregation.traffic, result.final_step)
    mean = schedule.mean_traffic()  # per device, averaged over the run's steps
    traffic, messages = mean.as_dict(), mean.messages_as_dict()
    compute = step_flops.of_run(config, trainer, result.median_step_time, exchange_seconds,
                                example_spec)
    report = link_report.report_of_run(trainer, config.links, schedule, compute)
    train_writer.scalars(result.final_step, {
        **summaries.aggregation_scalars(traffic, exchange_seconds),
        **link_scalars.scalars(report)})
    eval_metrics = monitor.eval_at(result.final_step)
    train_writer.close()
    eval_writer.close()
    if chief:
        summaries.write_final_metrics(config.logdir, result.final_step, {
            "final/train_loss": result.train.get("loss"),
            "final/eval_accuracy": eval_metrics.get("accuracy"),
            "final/examples_per_sec": result.examples_per_sec,
            **link_scalars.final_metrics(report)}, link_scalars.final_texts(report))
    return Measured(eval_metrics, traffic, messages, report, exchange_seconds)


def export_model(config: Config, trainer: Trainer) -> str:
    """The method's model (Trainer.global_model: the one evaluated) exported into
    --export_dir (export.py); one log line."""
    path = export.export_model(trainer.global_model(), config.export_dir)
    logging.info("exported the method's model (%s) to %s", trainer.evaluated_model, path)
    return path


def trained(config: Config, trainer: Trainer, device_set, total_towers: int, workers,
            result: controller.FitResult, measured: Measured, export_path: str | None) -> dict:
    """The summary of a run trained to its end (summary.json, `RunResult.summary`)."""
    eval_metrics = measured.eval_metrics
    failures = trainer.aggregation.failure_schedule()  # None: no node goes down
    summary = {
        "config": config.flat(),
        "num_towers": total_towers,
        "num_workers": workers.num_workers if workers else 1,
        "tower_devices": list(device_set.towers),
        "simulated_devices": device_set.simulated,
        "start_step": result.start_step,
        "final_step": result.final_step,
        "final_train_loss": result.train.get("loss"),
        "final_train_accuracy": result.train.get("accuracy"),
        "eval_loss": eval_metrics.get("loss"),
        "eval_accuracy": eval_metrics.get("accuracy"),  # None: the loss defines none
        "train_metrics": metrics_lib.values_of(result.train, trainer.metrics),
        "eval_metrics": metrics_lib.values_of(eval_metrics, trainer.metrics),
        "evaluated_model": trainer.evaluated_model,  # evaluated, exported (inference.py)
        "async_staleness": async_run.staleness_of(trainer.aggregation),  # async_diloco
        "training": {"loss": trainer.spec.sources["loss"], "loss_fn": repr(trainer.loss_fn),
                     "metrics_from": trainer.spec.sources["metrics"],
                     "metrics": [m.name for m in trainer.metrics],
                     "optimizer": trainer.spec.sources["optimizer"]},
        "stopped_by": (callbacks_lib.name_of(result.stopped_by)
                       if result.stopped_by is not None else None),
        "final_train_perplexity": result.train.get("perplexity"),  # None: not a language model
        "eval_perplexity": eval_metrics.get("perplexity"),
        "examples_per_sec": result.examples_per_sec,
        "median_step_time": result.median_step_time,
        "traced_step_seconds": result.traced_step_seconds,  # not in any speed above
        "traffic_bytes_per_step": measured.traffic,
        "traffic_messages_per_step": measured.messages,
        # per device: its optimizer state, and the weight entries --shard_update holds again
        "optimizer_bytes_per_device": trainer.replicas.optimizer_bytes(),
        "link_model": measured.link_report,
        "exchange_seconds": measured.exchange_seconds,
        "input_wait": result.input_wait,
        "input_wait_fraction": result.input_wait_fraction,
        "input_ended": result.input_ended,
        "export_path": export_path,
        "node_failures": failures.as_records() if failures else None,
    }
    summary.update(elastic_summary.keys_at_end(
        config, trainer, result.start_step, result.final_step,
        f"done: trained to step {result.final_step}"))
    return summary


def write_summary(config: Config, summary_path: str, summary: dict, save_rescue) -> None:
    """summary.json, written atomically; if the logdir is gone, the checkpoint is rescued
    (monitor.logdir_guard)."""
    with monitor_lib.logdir_guard(config.logdir, save_rescue):
        summaries.write_json_atomically(summary_path, summary)


def ended(summary_path: str) -> bool:
    """Whether summary.json is a run's end (`trained`'s); not one stopped by a signal, which
    a later round or run may have trained past before it failed (an elastic round lost at
    the last step): that run ends again, with the final eval and summary, training nothing."""
    if not os.path.exists(summary_path):
        return False
    with open(summary_path) as handle:
        return not json.load(handle).get("preempted")


def finished(config: Config, trainer: Trainer, step: int, summary_path: str,
             chief: bool) -> dict:
    """A run whose checkpoint is already at --train_steps or past it: trains nothing,
    leaves summary.json (and config.json) as they are and returns that summary; exports
    the restored model if --export_dir asks for it."""
    logging.info("the run in --logdir=%s is finished: its checkpoint is at step %d and "
                 "--train_steps=%d, so nothing is trained and %s is left as it is; pass "
                 "--train_steps > %d to train on", config.logdir, step, config.train_steps,
                 summary_path, step)
    with open(summary_path) as handle:
        summary = json.load(handle)
    if config.export_dir and chief:
        summary["export_path"] = export_model(config, trainer)
    return summary


def stopped(config: Config, result: controller.FitResult, stop: preemption.StopOnSignal,
            summary_path: str, checkpointer: checkpoint.Checkpointer | None, save_rescue,
            chief: bool, trainer: Trainer) -> dict:
    """The end of a run stopped by a signal: no final eval or export (the resumed run does
    them); summary.json says where it stopped; one log line (at DEBUG when an outer
    StopOnSignal owns the signals and reports the stop itself: a sweep's)."""
    name = signal.Signals(stop.signum).name
    summary = {"config": config.flat(), "start_step": result.start_step,
               "final_step": result.final_step,
               "final_train_loss": result.train.get("loss"),
               "final_train_accuracy": result.train.get("accuracy"),
               "eval_loss": None, "eval_accuracy": None, "export_path": None,
               "examples_per_sec": result.examples_per_sec,
               "median_step_time": result.median_step_time,
               "preempted": {"signal": name, "step": result.final_step}}
    if chief:  # an elastic round stopped to take a slot back: every round so far
        summary.update(elastic_summary.keys_at_end(config, trainer, result.start_step,
                                                   result.final_step, f"stopped by {name}"))
    level = logging.DEBUG if stop.nested else logging.WARNING
    if chief:
        write_summary(config, summary_path, summary, save_rescue)
        logging.log(level, "stopped by %s after step %d of %d: checkpoint %s saved; run the "
                    "same command to resume", name, result.final_step, config.train_steps,
                    checkpointer.latest)
    else:
        logging.log(level, "stopped by %s after step %d of %d (the chief saved the "
                    "checkpoint)", name, result.final_step, config.train_steps)
    return summary
