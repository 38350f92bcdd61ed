"""One experiment from a Config: validate, set up devices, build, train, evaluate, export.

This is the Python entry point (`mgloop.run`); `python -m mgloop.train` is a
thin absl wrapper around it. Every setting is validated before the first device
or variable exists; whether the data fits the batch (`--drop_remainder`) and has
eval examples is checked as soon as the data is in memory, before any variable
exists; whether the model takes the data's examples, as soon as the template
model exists (model_input.py), before its copies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
from typing import Callable

from absl import logging
import keras
import tensorflow as tf

from mgloop import aggregation
from mgloop.runs import assemble, export
from mgloop.runs import callbacks as callbacks_lib
from mgloop.runs import checkpoint
from mgloop.cluster import workers as cluster
from mgloop.runs import node_checkpoint
from mgloop import data
from mgloop.data import epochs
from mgloop.cluster import devices
from mgloop.observe import link_model
from mgloop.runs import controller
from mgloop.runs import logdir_lock
from mgloop.spec import losses
from mgloop.spec import metrics as metrics_lib
from mgloop import models
from mgloop.runs import monitor as monitor_lib
from mgloop.spec import optim
from mgloop.spec import perplexity
from mgloop.cluster import peer_health
from mgloop.runs import preemption
from mgloop.runs import run_dir
from mgloop.runs import run_result
from mgloop.data import staging
from mgloop.observe import summaries
from mgloop.spec import training_spec
from mgloop.aggregation import nodes
from mgloop.aggregation.cross_worker import CrossWorker
from mgloop.runs.config import Config
from mgloop.errors import ConfigError
from mgloop.runs.trainer import Trainer

SUMMARY_FILENAME = "summary.json"


def default_loss():
    """The cross-entropy matched to the model's output when the Trainer is built
    (mgloop.spec.losses): on logits (softmax over K > 1, sigmoid for one), or on the
    probabilities of a softmax or sigmoid output layer, per example or token."""
    return losses.cross_entropy


def seed_everything(seed: int, deterministic: bool) -> None:
    keras.utils.set_random_seed(seed)
    if deterministic:
        tf.config.experimental.enable_op_determinism()


def check_data(dataset: data.InMemoryDataset, config: Config) -> None:
    """Refuses data the run cannot use, before any variable exists: a global batch
    larger than an epoch (`epochs.check_fits`), or an empty eval split (every run
    evaluates after training, and every --eval_every steps)."""
    epochs.check_fits(dataset, config.global_batch_size, config.drop_remainder)
    if len(dataset.eval_y) == 0:
        raise ConfigError(f"--dataset={dataset.name} has no eval examples, but every run "
                          "evaluates after training (and every --eval_every steps); give the "
                          "dataset at least one eval example")


def build_trainer(config: Config, device_set: devices.DeviceSet,
                  model_fn: Callable[[], keras.Model], loss_fn, input_shape,
                  workers: cluster.Cluster | None = None, metrics=None,
                  optimizer=None) -> Trainer:
    """Seeds, then builds the template model, its copies, their optimizers, the step the
    config asks for (assemble.py) and the staging. `loss_fn`, `metrics`, `optimizer`:
    None takes the compiled model's, else mgloop's defaults (training_spec.py).

    With --nodes=N > 1 the method runs between the nodes (aggregation/nodes.py); with
    several workers, the aggregation is wrapped in the cross-worker stage."""
    asked = devices.parse(config.devices, config.towers_per_device).num_towers
    if device_set.num_towers != asked:  # a caller's mistake (e.g. K left out)
        raise ValueError(f"the device set has {device_set.num_towers} towers but the config "
                         f"asks for {asked} per process: make it with devices.setup("
                         "devices.parse(config.devices, config.towers_per_device))")
    seed_everything(config.seed, config.deterministic)
    method = nodes.make(config, device_set, aggregation.make, workers)
    if workers is not None and workers.num_workers > 1:
        method = CrossWorker(method, workers)
    return assemble.build(model_fn, loss_fn, method,
                          functools.partial(optim.make_optimizer, config), input_shape, config,
                          staging.make(config.staging, config.staging_depth, device_set.towers,
                                       config.accumulation_steps),
                          metrics=metrics, optimizer=optimizer)


def run(config: Config, model_fn: Callable[[], keras.Model] | None = None, loss=None,
        train_data=None, eval_data=None, metrics=None, optimizer=None, callbacks=None, *,
        command_line: list[str] | None = None, loss_fn=None,
        dataset=None) -> run_result.RunResult:
    """Trains per `config`; returns a RunResult (run_result.py: the trained template model,
    the history, and the summary, also written to <logdir>/summary.json, read by indexing).

    `model_fn` (no arguments, returns a Keras model, compiled or not) overrides `--model`.
    `loss`, `metrics`, `optimizer`: as given, else the compiled model's, else the default
    cross-entropy (matched to the model's output, losses.py), accuracy where that loss
    defines one, the flag-driven optimizer (training_spec.py; the log says which).
    `train_data` and `eval_data` take whatever `data.as_input` accepts (user_input.py:
    tf.data pipelines, functions of an InputContext, arrays; `train_data` None: --dataset);
    without eval data (a user's training data and no `eval_data`) the run evaluates
    nothing. `callbacks`: functions
    (step, metrics) -> stop?, called after every compiled loop (callbacks.py).
    `final_train_accuracy` and `eval_accuracy` are None where no accuracy is defined;
    `train_metrics`/`eval_metrics` hold every metric. `loss_fn=` and `dataset=` are the
    old names of `loss=` and `train_data=` (deprecated: a warning, same behaviour).
    `command_line` (e.g. sys.argv) is recorded as TensorBoard text.
    The chief holds `<logdir>/mgloop.lock` for the run (logdir_lock.py: a second run on
    the logdir is refused). SIGTERM or SIGINT ends the run after the current loop with a
    checkpoint of that step; the summary then holds `"preempted": {"signal", "step"}`
    (preemption.py).
    """
    config = config.validated()
    loss = training_spec.renamed("loss_fn", loss_fn, "loss", loss)
    dataset = train_data = training_spec.renamed("dataset", dataset, "train_data", train_data)
    training_spec.check_arguments(loss, metrics, optimizer, callbacks)
    callbacks_lib.check(callbacks, config.eval_every)
    if isinstance(dataset, data.InMemoryDataset):  # check that it fits before any device exists
        check_data(dataset, config)
    for value, what in ((dataset, "train_data"), (eval_data, "eval_data")):
        data.user_input.check_accepted(value, what)  # one line, before any device exists
    request = devices.parse(config.devices, config.towers_per_device)
    workers = cluster.from_environment()
    chief = workers is None or workers.is_chief  # writes summaries, checkpoints, the export
    with (logdir_lock.held(config.logdir, hold=chief), preemption.StopOnSignal() as stop,
          contextlib.ExitStack() as on_exit):
        return _run(config, model_fn, training_spec.Given(loss, metrics, optimizer, callbacks),
                    (dataset, eval_data), command_line, request, workers, chief, stop, on_exit)


def _run(config: Config, model_fn, given: training_spec.Given, dataset, command_line,
         request, workers, chief: bool, stop: preemption.StopOnSignal,
         on_exit: contextlib.ExitStack) -> run_result.RunResult:
    """`run` after validation, holding the logdir's lock, with the signal handlers set;
    `on_exit` stops the peers' health checks however `run` ends (an error included)."""
    device_set = devices.setup(request, workers, config.startup_timeout)
    # until the last collective between workers (stopped there, or on any exit)
    health = on_exit.enter_context(peer_health.watch(workers, config.collective_timeout))
    logging.info("logdir: %s", config.logdir)
    # readers may start TensorFlow: after the devices, before variables
    train_data, eval_data = dataset
    train = data.as_input(train_data, config, workers, "train_data")
    evaluation = (data.as_input(eval_data, config, workers, "eval_data") if eval_data is not None
                  else train if train.has_eval_split else None)
    logging.info("training data: %s; eval data: %s", train.description,
                 evaluation.description if evaluation else "none (nothing is evaluated)")
    callbacks_lib.check(given.callbacks, config.eval_every, evaluation is not None)
    if model_fn is None:
        if train.num_classes is None or train.input_shape is None:
            raise ConfigError(f"--model={config.model} needs one feature tensor and the number "
                              f"of classes, which {train.description} does not give; pass "
                              "model_fn")
        model_fn = models.builder_of(config, train.input_shape, train.num_classes)
    trainer = build_trainer(config, device_set, model_fn, given.loss, train.input_shape,
                            workers, given.metrics, given.optimizer)
    train.check_model(trainer.model)
    checkpointer = checkpoint.Checkpointer(
        os.path.join(config.logdir, "checkpoints"), trainer.model, trainer.copies[0].optimizer,
        trainer.global_step, keep=config.keep_checkpoints, aggregation=trainer.aggregation,
        copies=trainer.replicas.checkpointed_copies)
    restored = checkpointer.restore_latest(tidy=chief)
    own = node_checkpoint.node_variables(trainer.aggregation, trainer.copies)
    saver = (node_checkpoint.NodeCheckpoints(
        os.path.join(config.logdir, "checkpoints"), workers.index, own,
        config.keep_checkpoints, checkpointer if chief else None) if own
        else checkpointer if chief else None)
    if restored:
        if not checkpointer.restored_every_copy:  # else every copy was saved and restored
            trainer.sync_replicas()
        if own:  # this node's own state, of the same step (node_checkpoint.py)
            saver.restore(int(trainer.global_step.numpy()), config.logdir)
        logging.info("resumed from %s at step %d", restored, int(trainer.global_step.numpy()))
    # several processes: every worker starts from worker 0's, but for its node's own state
    trainer.broadcast_from_chief(keep=own if restored else ())
    start_step = int(trainer.global_step.numpy())
    summary_path = os.path.join(config.logdir, SUMMARY_FILENAME)
    if restored and start_step >= config.train_steps and os.path.exists(summary_path):
        return run_result.RunResult(_finished(config, trainer, start_step, summary_path, chief),
                                    trainer)
    if chief:  # the settings the checkpoints of this logdir are made with (run_dir.check_resumable)
        run_dir.write_config(config)
    batches = train.train_batches(start_step)  # this worker's part, from the step on
    total_towers = device_set.num_towers * (workers.num_workers if workers else 1)
    if chief:
        summaries.write_run_record(config.logdir, config, total_towers, command_line)
    writer = summaries.ScalarWriter if chief else summaries.NullWriter  # the chief writes
    train_writer, eval_writer = writer(config.logdir, "train"), writer(config.logdir, "eval")
    learning_rate = (optim.compiled_schedule(optim.make_schedule(config))
                     if trainer.spec.sources["optimizer"].startswith("default")
                     else optim.current_rate(trainer.copies[0].optimizer))
    history = callbacks_lib.History(config.summary_every or config.log_every)
    # The eval pipeline is built once, at the first evaluation, and iterated anew each
    # time: building it per evaluation traced its map functions again and kept ~2 KiB of
    # TensorFlow's memory per evaluation for the rest of the run (issue 23).
    eval_batches = functools.cache(evaluation.eval_batches) if evaluation else None
    monitor = monitor_lib.Monitor(
        trainer, train_writer, eval_writer,
        (lambda: trainer.evaluate(eval_batches())) if evaluation else dict,
        eval_every=config.eval_every, histogram_every=config.histogram_every,
        profile_steps=(monitor_lib.parse_profile_steps(config.profile_steps, config.train_steps)
                       if config.profile_steps and chief else None),
        profile_dir=config.logdir, breakdown_every=config.breakdown_every if chief else 0)

    def save_rescue(folder):
        return checkpoint.Checkpointer(os.path.join(folder, "checkpoints"), trainer.model,
                                       trainer.copies[0].optimizer, trainer.global_step,
                                       keep=1, aggregation=trainer.aggregation,
                                       copies=trainer.replicas.checkpointed_copies
                                       ).save(int(trainer.global_step.numpy()))

    guard = (monitor_lib.logdir_guard(config.logdir, save_rescue) if chief
             else contextlib.nullcontext())
    with guard, health:
        try:
            result = controller.fit(
                trainer, batches, config.train_steps,
                config.global_batch_size * config.accumulation_steps, config.steps_per_loop,
                summary_every=config.summary_every, log_every=config.log_every,
                checkpoint_every=config.checkpoint_every, summaries=train_writer,
                checkpointer=saver,
                learning_rate=learning_rate, monitor=monitor,
                should_stop=preemption.stop_check(stop, trainer.aggregation),
                callbacks=[history, *(given.callbacks or ())])
        finally:
            monitor.stop_profile()
        if result.stopped:
            health.stop()  # the workers agreed to stop: no collective between them from here
            train_writer.close()
            eval_writer.close()
            return run_result.RunResult(_stopped(config, result, stop,
                                                 checkpointer if chief else None, save_rescue,
                                                 chief), trainer, history)
        exchange_seconds = trainer.time_exchange() if result.final_step > start_step else None
        health.stop()  # no collective between workers from here on: a peer may now exit
        traffic = trainer.aggregation.traffic.as_dict()
        link_report = link_model.report_of_run(trainer, config.links, result.median_step_time,
                                               exchange_seconds)
        train_writer.scalars(result.final_step, {
            **summaries.aggregation_scalars(traffic, exchange_seconds),
            **link_model.scalars(link_report)})
        eval_metrics = monitor.eval_at(result.final_step)
        train_writer.close()
        eval_writer.close()
        if chief:
            summaries.write_final_metrics(config.logdir, result.final_step, {
                "final/train_loss": result.train.get("loss"),
                "final/eval_accuracy": eval_metrics.get("accuracy"),
                "final/examples_per_sec": result.examples_per_sec,
                **link_model.final_metrics(link_report)})
    if eval_metrics:
        logging.info("eval at step %d: loss %.4f%s", result.final_step, eval_metrics["loss"],
                     metrics_lib.log_text(eval_metrics, trainer.metrics))
    export_path = None
    if config.export_dir and chief:
        export_path = export.export_model(trainer.model, config.export_dir)
        logging.info("exported the template model to %s", export_path)
    summary = {
        "config": dataclasses.asdict(config),
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
        "traffic_bytes_per_step": traffic,
        "traffic_messages_per_step": trainer.aggregation.traffic.messages_as_dict(),
        "link_model": link_report,
        "exchange_seconds": exchange_seconds,
        "input_wait": result.input_wait,
        "input_wait_fraction": result.input_wait_fraction,
        "input_ended": result.input_ended,
        "export_path": export_path,
    }
    if chief:
        with monitor_lib.logdir_guard(config.logdir, save_rescue):
            summaries.write_json_atomically(summary_path, summary)
    return run_result.RunResult(summary, trainer, history)


def _finished(config: Config, trainer: Trainer, step: int, summary_path: str,
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
        summary["export_path"] = export.export_model(trainer.model, config.export_dir)
        logging.info("exported the template model to %s", summary["export_path"])
    return summary


def _stopped(config: Config, result: controller.FitResult, stop: preemption.StopOnSignal,
             checkpointer: checkpoint.Checkpointer | None, save_rescue, chief: bool) -> dict:
    """The end of a run stopped by a signal: no final eval or export (the resumed run does
    them); summary.json says where it stopped; one log line."""
    name = signal.Signals(stop.signum).name
    summary = {"config": dataclasses.asdict(config), "start_step": result.start_step,
               "final_step": result.final_step,
               "final_train_loss": result.train.get("loss"),
               "final_train_accuracy": result.train.get("accuracy"),
               "eval_loss": None, "eval_accuracy": None, "export_path": None,
               "examples_per_sec": result.examples_per_sec,
               "median_step_time": result.median_step_time,
               "preempted": {"signal": name, "step": result.final_step}}
    if chief:
        with monitor_lib.logdir_guard(config.logdir, save_rescue):
            summaries.write_json_atomically(os.path.join(config.logdir, SUMMARY_FILENAME),
                                            summary)
        logging.warning("stopped by %s after step %d of %d: checkpoint %s saved; run the "
                        "same command to resume", name, result.final_step, config.train_steps,
                        checkpointer.latest)
    else:
        logging.warning("stopped by %s after step %d of %d (the chief saved the checkpoint)",
                        name, result.final_step, config.train_steps)
    return summary
