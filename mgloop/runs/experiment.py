"""One experiment from a Config: validate, set up devices, build, train, evaluate, export.

This is the Python entry point (`mgloop.run`); `python -m mgloop.train` is a
thin absl wrapper around it. Every setting is validated before the first device
or variable exists; whether the data fits the batch (`--drop_remainder`) and has
eval examples is checked as soon as the data is in memory, before any variable
exists; whether the model takes the data's examples, as soon as the template
model exists (model_input.py), before its copies. What a run does once training
ends (measures, summary.json, a stop by a signal, nothing left to train) is run_end.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Callable
import zlib

from absl import logging
import keras
import tensorflow as tf

from mgloop import aggregation
from mgloop import data
from mgloop import models
from mgloop.aggregation.local import async_run
from mgloop.aggregation.placement import between_nodes, node_failures
from mgloop.cluster import devices
from mgloop.cluster import peer_health
from mgloop.cluster import workers as workers_lib
from mgloop.data import epochs
from mgloop.data import staging
from mgloop.errors import ConfigError
from mgloop.observe import summaries
from mgloop.runs import assemble
from mgloop.runs import callbacks as callbacks_lib
from mgloop.runs import checkpoint
from mgloop.runs import controller
from mgloop.runs import logdir_lock
from mgloop.runs import monitor as monitor_lib
from mgloop.runs import elastic_summary, node_checkpoint
from mgloop.runs import preemption
from mgloop.runs import run_dir
from mgloop.runs import run_end
from mgloop.runs import run_inputs
from mgloop.runs import run_result
from mgloop.runs.config import Config
from mgloop.runs.trainer import Trainer
from mgloop.step import replicas
from mgloop.step.hooks import Hook
from mgloop.training import losses
from mgloop.training import metrics as metrics_lib
from mgloop.training import optim
from mgloop.training import training_spec

SUMMARY_FILENAME = "summary.json"


def default_loss():
    """The cross-entropy matched to the model's output when the Trainer is built
    (mgloop.training.losses): on logits (softmax over K > 1, sigmoid for one), or on the
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
                  workers: workers_lib.Cluster | None = None, metrics=None,
                  optimizer=None, hooks=()) -> Trainer:
    """Seeds, then builds the template model, its copies, their optimizers, the step the
    config asks for (assemble.py) and the staging. `loss_fn`, `metrics`, `optimizer`:
    None takes the compiled model's, else mgloop's defaults (training_spec.py). `hooks`:
    the user's step hooks, after mgloop's (assemble.build).

    With --nodes=N > 1 the method runs between the nodes (placement/between_nodes.py); with
    several workers, the aggregation is wrapped in the cross-worker stage."""
    asked = devices.parse(config.devices, config.towers_per_device).num_towers
    if device_set.num_towers != asked:  # a caller's mistake (e.g. K left out)
        raise ValueError(f"the device set has {device_set.num_towers} towers but the config "
                         f"asks for {asked} per process: make it with devices.setup("
                         "devices.parse(config.devices, config.towers_per_device))")
    seed_everything(config.seed, config.deterministic)
    make = async_run.with_node_speeds(aggregation.make, config.node_speeds)  # its clock
    method = between_nodes.make(config.exchange, device_set, make, workers,
                                node_failures.schedule_of(config.exchange, config.train_steps),
                                replicas.global_step_on(device_set.host))
    optimizer_fn = optim.FlagOptimizer(config.optim, config.train_steps)
    return assemble.build(model_fn, loss_fn, method, optimizer_fn, input_shape, config,
                          staging.make(config.staging, config.staging_depth, device_set.towers,
                                       config.accumulation_steps),
                          metrics=metrics, optimizer=optimizer, hooks=hooks)


def run(config: Config, model_fn: Callable[[], keras.Model] | None = None, loss=None,
        train_data=None, eval_data=None, metrics=None, optimizer=None, callbacks=None, *,
        command_line: list[str] | None = None, hooks=()) -> run_result.RunResult:
    """Trains per `config`; returns a RunResult (run_result.py: the trained template model,
    the history, and the summary, also written to `<logdir>/summary.json`, read by indexing).

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
    `train_metrics`/`eval_metrics` hold every metric.
    `command_line` (e.g. sys.argv) is recorded as TensorBoard text. `hooks`: step hooks
    of your own (`mgloop.step.hooks.Hook` subclasses), after mgloop's, in every step.
    The chief holds `<logdir>/mgloop.lock` for the run (logdir_lock.py: a second run on
    the logdir is refused). A refused run (any error) leaves no folder behind: the logdir
    folders its validation made are removed while still empty. SIGTERM or SIGINT ends the run after the current loop with a
    checkpoint of that step; the summary then holds `"preempted": {"signal", "step"}`
    (preemption.py).
    """
    config = dataclasses.replace(config, logdir=config.logdir or run_dir.fresh_logdir())
    with run_dir.removed_if_left_empty(config.logdir):  # a refused run leaves no folder
        config = config.validated()
        training_spec.check_arguments(loss, metrics, optimizer, callbacks)
        for hook in hooks:
            if not isinstance(hook, Hook):
                raise ConfigError(f"hooks: {hook!r} is not a mgloop.step.hooks.Hook; give "
                                  "instances of Hook subclasses")
        callbacks_lib.check(callbacks, config.eval_every)
        if isinstance(train_data, data.InMemoryDataset):  # check that it fits before any device exists
            check_data(train_data, config)
        for value, what in ((train_data, "train_data"), (eval_data, "eval_data")):
            data.user_input.check_accepted(value, what)  # one line, before any device exists
        request = devices.parse(config.devices, config.towers_per_device)
        workers = workers_lib.from_environment()
        chief = workers is None or workers.is_chief  # writes summaries, checkpoints, the export
        with (logdir_lock.held(config.logdir, hold=chief), preemption.StopOnSignal() as stop,
              contextlib.ExitStack() as on_exit):
            return _run(config, model_fn,
                        training_spec.Given(loss, metrics, optimizer, callbacks, tuple(hooks)),
                        (train_data, eval_data), command_line, request, workers, chief, stop, on_exit)


def _run(config: Config, model_fn, given: training_spec.Given, dataset, command_line,
         request, workers, chief: bool, stop: preemption.StopOnSignal,
         on_exit: contextlib.ExitStack) -> run_result.RunResult:
    """`run` after validation, holding the logdir's lock, with the signal handlers set;
    `on_exit` stops the peers' health checks however `run` ends (an error included).
    Top to bottom: devices, data, the trainer, the restore, training, then the run's end
    (run_end.py)."""
    device_set = devices.setup(request, workers, config.startup_timeout)
    # until the last collective between workers (stopped there, or on any exit)
    health = on_exit.enter_context(peer_health.watch(workers, config.collective_timeout))
    logging.info("logdir: %s", config.logdir)
    train, evaluation = run_inputs.inputs(config, dataset, workers)
    callbacks_lib.check(given.callbacks, config.eval_every, evaluation is not None)
    trainer = build_trainer(config, device_set, _model_builder(config, model_fn, train),
                            given.loss, train.input_shape, workers, given.metrics,
                            given.optimizer, given.hooks)
    train.check_model(trainer.model)
    checkpointer, saver, restored = _restore(config, trainer, workers, chief)
    start_step = int(trainer.global_step.numpy())
    summary_path = os.path.join(config.logdir, SUMMARY_FILENAME)
    if restored and start_step >= config.train_steps and run_end.ended(summary_path):
        return run_result.RunResult(
            run_end.finished(config, trainer, start_step, summary_path, chief), trainer)
    if chief:  # the settings the checkpoints of this logdir are made with (run_dir.check_resumable)
        run_dir.write_config(config)
    batches = train.train_batches(start_step)  # this worker's part, from the step on
    total_towers = device_set.num_towers * (workers.num_workers if workers else 1)
    if chief:
        run_dir.write_run_record(config, total_towers, command_line)
    writer = summaries.ScalarWriter if chief else summaries.NullWriter  # the chief writes
    train_writer, eval_writer = writer(config.logdir, "train"), writer(config.logdir, "eval")
    learning_rate = _learning_rate(config, trainer)
    history = callbacks_lib.History(config.summary_every or config.log_every)
    monitor = _monitor(config, trainer, train_writer, eval_writer, evaluation, chief)
    node_saver = saver if isinstance(saver, node_checkpoint.NodeCheckpoints) else None
    save_rescue = run_end.rescue_saver(trainer, node_saver, chief)
    guard = (monitor_lib.logdir_guard(config.logdir, save_rescue, _rescue_stamp(workers))
             if chief or node_saver else contextlib.nullcontext())
    with guard, health:
        try:
            plan = controller.LoopPlan(
                config.train_steps, config.global_batch_size * config.accumulation_steps,
                config.steps_per_loop, config.summary_every, config.log_every,
                config.checkpoint_every)
            parts = controller.LoopParts(
                trainer, batches, summaries=train_writer,
                checkpointer=elastic_summary.ledger(  # an elastic round's counts
                    saver, config.logdir, trainer.aggregation.traffic, start_step,
                    config.keep_checkpoints, chief),
                learning_rate=learning_rate, monitor=monitor,
                should_stop=preemption.stop_check(stop, trainer.aggregation),
                callbacks=(history, *(given.callbacks or ())))
            result = controller.Controller(plan, parts).train()
        finally:
            monitor.stop_profile()
        if result.stopped:
            health.stop()  # the workers agreed to stop: no collective between them from here
            train_writer.close()
            eval_writer.close()
            return run_result.RunResult(
                run_end.stopped(config, result, stop, summary_path,
                                checkpointer if chief else None, save_rescue, chief, trainer),
                trainer, history)
        measured = run_end.measure(config, trainer, result, start_step, health, monitor,
                                   train_writer, eval_writer, chief,
                                   (train.features_spec, train.labels_spec))
    if measured.eval_metrics:
        logging.info("eval at step %d: loss %.4f%s", result.final_step,
                     measured.eval_metrics["loss"],
                     metrics_lib.log_text(measured.eval_metrics, trainer.metrics))
    export_path = (run_end.export_model(config, trainer) if config.export_dir and chief
                   else None)
    summary = run_end.trained(config, trainer, device_set, total_towers, workers, result,
                              measured, export_path)
    if chief:
        run_end.write_summary(config, summary_path, summary, save_rescue)
    return run_result.RunResult(summary, trainer, history)


def _model_builder(config: Config, model_fn, train) -> Callable[[], keras.Model]:
    """`model_fn` if given, else the builder of --model for the training input's feature
    shape and classes (ConfigError if it gives neither)."""
    if model_fn is not None:
        return model_fn
    if train.num_classes is None or train.input_shape is None:
        raise ConfigError(f"--model={config.model} needs one feature tensor and the number "
                          f"of classes, which {train.description} does not give; pass "
                          "model_fn")
    return models.builder_of(config.models, train.input_shape, train.num_classes)


def _restore(config: Config, trainer: Trainer, workers, chief: bool) -> tuple:
    """(the Checkpointer of <logdir>/checkpoints, the saver of this process's checkpoints or
    None, the restored checkpoint or None): restores the newest intact checkpoint and this
    node's own state of its step (node_checkpoint.py), then every worker starts from
    worker 0's values but for its node's own state."""
    folder = os.path.join(config.logdir, "checkpoints")
    checkpointer = checkpoint.Checkpointer.of_trainer(folder, trainer,
                                                      keep=config.keep_checkpoints)
    own = node_checkpoint.node_variables(trainer.aggregation, trainer.copies)
    restored = checkpointer.restore_latest(
        tidy=chief, incomplete=functools.partial(node_checkpoint.incomplete, folder))
    saver = (node_checkpoint.NodeCheckpoints(
        folder, workers.index, own, config.keep_checkpoints, checkpointer if chief else None,
        count=workers.num_workers) if own else checkpointer if chief else None)
    if restored:
        if not checkpointer.restored_every_copy:  # else every copy was saved and restored
            trainer.sync_replicas()
        if own:  # this node's own state, of the same step (node_checkpoint.py)
            change = saver.restore(int(trainer.global_step.numpy()), config.logdir,
                                   trainer.aggregation, trainer.copies)
            if change:
                logging.info("%s", change)
        logging.info("resumed from %s at step %d", restored, int(trainer.global_step.numpy()))
    # several processes: every worker starts from worker 0's, but for its node's own state
    trainer.broadcast_from_chief(keep=own if restored else ())
    return checkpointer, saver, restored


def _rescue_stamp(workers) -> str | None:
    """The name of a rescue folder the workers agree on without a message (the job's
    addresses, the same in every worker's TF_CONFIG); None in one process: the time."""
    if workers is None or workers.num_workers == 1:
        return None
    return f"{zlib.crc32(','.join(workers.workers).encode()):08x}"


def _learning_rate(config: Config, trainer: Trainer):
    """The compiled learning rate the loop logs: the flag-driven schedule's for the default
    optimizer, else the given optimizer's current rate."""
    return (optim.compiled_schedule(optim.make_schedule(config.optim, config.train_steps))
            if trainer.spec.sources["optimizer"].startswith("default")
            else optim.current_rate(trainer.copies[0].optimizer))


def _monitor(config: Config, trainer: Trainer, train_writer, eval_writer, evaluation,
             chief: bool) -> monitor_lib.Monitor:
    """What the outer loop does between loops (monitor.py): evaluations (none without an
    eval input), histograms, profiles and breakdowns (the chief's alone)."""
    # The eval pipeline is built once, at the first evaluation, and iterated anew each
    # time: building it per evaluation traced its map functions again and kept ~2 KiB of
    # TensorFlow's memory per evaluation for the rest of the run.
    eval_batches = functools.cache(evaluation.eval_batches) if evaluation else None

    def evaluate():  # the method's model; with --eval_each_node every node's copy beside
        metrics = trainer.evaluate(eval_batches())
        if config.eval_each_node:
            metrics.update(trainer.inference.evaluate_nodes(eval_batches()))
        return metrics
    return monitor_lib.Monitor(
        trainer, train_writer, eval_writer, evaluate if evaluation else dict,
        eval_every=config.eval_every, histogram_every=config.histogram_every,
        profile_steps=(monitor_lib.parse_profile_steps(config.profile_steps, config.train_steps)
                       if config.profile_steps and chief else None),
        profile_dir=config.logdir, breakdown_every=config.breakdown_every if chief else 0)
