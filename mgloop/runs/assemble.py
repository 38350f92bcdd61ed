"""Builds a Trainer: the template model, its copies, the step with its hooks, the loop.

Every choice about what the step does is made here, once, from the settings:
which hooks (hooks/__init__.py) the step gets, whether its pass accumulates
micro-batches, which exchange it runs (exchange.py), and which kind of step it is
(`TowerStep`, or `SingleLossStep` for a single-loss method). With --diagnostics a
second step, the sampled one, gets the gradient statistics' hook besides the others (the
loop runs it apart on the last step of a summary window: loop.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

from absl import logging
import keras
import tensorflow as tf

from mgloop.aggregation import Aggregation
from mgloop.data import staging as staging_lib
from mgloop.runs import inference
from mgloop.runs import loop
from mgloop.runs.config import Config
from mgloop.runs.trainer import Trainer
from mgloop.step import accumulation, compiled_towers
from mgloop.step import exchange as exchange_lib
from mgloop.step import ordered_sum
from mgloop.step import precision
from mgloop.step import random_streams as random_streams_lib
from mgloop.step import sync_batch_norm
from mgloop.step import pfor
from mgloop.step import vectorized_towers
from mgloop.step import sharded_update
from mgloop.step.hooks import Hook, Hooks, tape_gradients
from mgloop.step.hooks import attacks
from mgloop.step.hooks.attack_hook import ByzantineTowers
from mgloop.step.hooks.histograms import KeepLastGradients
from mgloop.step.hooks.inner_turns import hook_for as inner_turns_hook
from mgloop.step.hooks.large_gradients import OrderedSumHook, SufficientFactorsHook
from mgloop.step.hooks.loss_scaling import LossScaling
from mgloop.step.hooks.node_failures import hook_for as node_failures_hook
from mgloop.step.hooks.sampled_stats import GradientStats
from mgloop.step.hooks.synced_moments import SyncBatchNorm
from mgloop.step.replicas import Replicas, WholeUpdate
from mgloop.step.sharded_update import ShardedUpdate
from mgloop.step.single_loss_step import SingleLossStep
from mgloop.step.training_step import TowerStep
from mgloop.training import losses
from mgloop.training import metrics as metrics_lib
from mgloop.training import model_input
from mgloop.training import training_spec


def template_model(model_fn, aggregation: Aggregation, input_shape, mixed_precision: str):
    """The template model (variable copy 0), built on the aggregation's first parameter
    device under the precision policy; refused (one line) if it cannot take the data."""
    with aggregation.variable_scope(), precision.policy_scope(mixed_precision):
        model = model_fn()
        if not model.built or not model.variables:
            model(tf.zeros((1, *input_shape)))  # create a lazily built model's variables
    if input_shape is not None:  # before any copy: one line, not a traced traceback
        model_input.check_fits_data(model, input_shape)
    return model


def large_gradient_hooks(config: Config, replicas: Replicas, loss_scaling: bool) -> list:
    """The ordered sum and sufficient factors, where the towers' gradients of a variable may
    be summed at its home as they come: a shared layout summed at home on logical CPU
    towers (ordered_sum.applies), and not when every tower's gradients must be kept anyway
    (accumulation sums) nor with synchronised batch norm, whose backward
    passes meet in collectives and so cannot run one after another, nor with an omniscient
    attack (alie, ipm: it alters every tower's whole gradient once all exist, after the
    home sums; the sums are exact either way). Factoring also not with loss scaling (the
    finite check reads every tower's gradients) nor with --byzantine_towers (the attack
    alters every tower's whole gradient)."""
    aggregation = replicas.aggregation
    if config.xla_towers and ordered_sum.applies(aggregation):
        logging.info("--xla_towers: no ordered sum nor sufficient factors (they act inside "
                     "a tower's backward pass, which is one compiled function)")
        return []
    if replicas.towers_per_device > 1 and ordered_sum.applies(aggregation):
        logging.info("--towers_per_device=%d: no ordered sum nor sufficient factors (they sum "
                     "the towers' gradients at their homes one tower's pass at a time, and a "
                     "device's towers are one vectorized pass)", replicas.towers_per_device)
        return []
    if not (ordered_sum.applies(aggregation) and config.accumulation_steps == 1
            and not (config.batch_norm == "sync" and replicas.num_towers > 1)):
        return []
    if attacks.omniscient(config.step):
        logging.info("--attack=%s: no ordered sum nor sufficient factors (the attack needs "
                     "every tower's whole gradient)", config.attack)
        return []
    variables, devices = replicas.copies[0].trainable, replicas.tower_devices
    hooks = []
    if config.sufficient_factor_bytes and not loss_scaling and not config.byzantine_towers:
        factors = SufficientFactorsHook(aggregation, variables, config.sufficient_factor_bytes,
                                        devices)
        hooks += [factors] if factors.candidates else []
    if config.ordered_sum_bytes:
        order = OrderedSumHook(aggregation, variables, config.ordered_sum_bytes, devices)
        hooks += [order] if order.indices else []
    return hooks


def summed_at_home(large: list) -> list[int]:
    """Indices of the variables whose gradients `large` (large_gradient_hooks) may sum at
    their homes: no tower keeps its whole gradient of them, so the diagnostics' statistics
    leave them out (logged once), rather than the sampled step holding T copies of each."""
    indices = sorted({i for hook in large for i in hook.summed_at_home})
    if indices:
        logging.info("--diagnostics: the gradient statistics (grad norms, cosine, norm ratio) "
                     "leave out the %d large variables summed at their homes (ordered sum, "
                     "sufficient factors): indices %s", len(indices), indices)
    return indices


def build(model_fn: Callable[[], keras.Model], loss_fn, aggregation: Aggregation,
          optimizer_fn: Callable[[], keras.optimizers.Optimizer], input_shape=None,
          config: Config = Config(), staging: staging_lib.HostStaging | None = None,
          metrics: list | None = None, hooks: Sequence[Hook] = (),
          optimizer=None) -> Trainer:
    """A Trainer of `model_fn`'s model for `aggregation` with the step `config` asks for
    (grad_reduce, pack_bytes, accumulation_steps, mixed_precision, batch_norm,
    diagnostics, histogram_every, ordered_sum_bytes, sufficient_factor_bytes).
    `loss_fn`, `metrics`, `optimizer` (a Keras optimizer, name or factory): as given, else
    the compiled model's, else the default cross-entropy, accuracy where the loss defines
    it, and `optimizer_fn` (training_spec.py; `Trainer.spec` says which were used).
    `hooks`: a user's own hooks (hooks/__init__.py), after mgloop's, in every step.
    Top to bottom: the template and what it trains with (all refusals before any copy),
    the copies, the hooks of every step, the passes and staging, the step and its loop."""
    model, spec, attack, classes = template_and_spec(
        model_fn, loss_fn, aggregation, optimizer_fn, input_shape, config, metrics, optimizer)
    if config.shard_update:  # a user's hook that reads whole gradients: refused before copies
        sharded_update.check_hooks(hooks)
    replicas = Replicas(model, aggregation, spec.optimizer_fn,
                        functools.partial(ShardedUpdate, bucket_bytes=config.pack_bytes)
                        if config.shard_update else WholeUpdate)
    # each tower draws its own random numbers (dropout masks), by its global index
    first_tower = aggregation.cluster.index * replicas.num_towers if aggregation.cluster else 0
    streams = random_streams_lib.RandomStreams(model, first_tower)
    common = common_hooks(config, model, replicas, attack, classes, first_tower, hooks)
    compiled = compiled_pass(config, common.hooks)
    passes = micro_batch_passes(config, replicas, common.units, spec.metrics)
    staging = staging or staging_lib.make("device", 2, replicas.tower_devices,
                                          config.accumulation_steps)
    parts = StepParts(replicas, spec.loss_fn, spec.metrics, common, passes, streams, compiled)
    step, train_loop = (single_loss_loop(config, parts, staging)
                        if aggregation.capabilities.single_loss
                        else tower_loop(config, parts, staging))
    # the method's model, evaluated and exported, on the side of the copies (inference.py)
    evaluated = inference.evaluation_model(model, model_fn, aggregation, input_shape,
                                           config.mixed_precision)
    return Trainer(replicas, step, train_loop,
                   inference.TowerInference(replicas, spec.loss_fn, spec.metrics, evaluated),
                   streams, spec,
                   # one log line per leave and return
                   common.failures.logging_loop(train_loop.train_loop, replicas.global_step)
                   if common.failures else None)


def template_and_spec(model_fn, loss_fn, aggregation: Aggregation, optimizer_fn, input_shape,
                      config: Config, metrics, optimizer) -> tuple:
    """(the template model, the training spec, the attack, labelflip's classes or None): the
    model checked by the method and, with several towers per copy, by the vectorizer, all
    before any copy (one line if refused)."""
    model = template_model(model_fn, aggregation, input_shape, config.mixed_precision)
    aggregation.check_model(model.trainable_variables)  # before any copy: one line if not
    spec = training_spec.resolve(model, loss_fn, metrics, optimizer, losses.cross_entropy,
                                 optimizer_fn, input_shape)
    if config.shard_update:  # an element-wise optimizer, before any copy (one line if not)
        sharded_update.check_optimizer(spec.optimizer_fn())
    attack = attacks.parse_attack(config.attack)
    # labelflip's C: known once the template and the loss are, refused before any copy
    classes = (attacks.label_classes(spec.loss_fn, model, input_shape)
               if config.byzantine_towers and attack.name == "labelflip" else None)
    if len(aggregation.devices.copy_devices) < aggregation.devices.num_towers:
        pfor.probe(model, input_shape)  # before any copy: one line if it cannot
    return model, spec, attack, classes


@dataclasses.dataclass(frozen=True)
class CommonHooks:
    """The hooks of every step, in data-path order, and what the steps read of them."""

    hooks: list
    units: list  # where a step's gradients are: the host (single loss), else the towers
    byzantine: ByzantineTowers | None  # --byzantine_towers' attack, read by the statistics
    loss_scaling: bool
    failures: object  # the nodes' failure schedule (placement/node_failures.py), or None


def common_hooks(config: Config, model, replicas: Replicas, attack, classes, first_tower: int,
                 hooks: Sequence[Hook]) -> CommonHooks:
    """mgloop's hooks of every step the config asks for, then the user's `hooks`; refused
    (one line) where the towers of a device are one vectorized pass and a hook cannot be."""
    aggregation = replicas.aggregation
    single_loss = aggregation.capabilities.single_loss
    units = [aggregation.devices.host] if single_loss else replicas.tower_devices
    common = []  # the hooks of every step, in data-path order
    byzantine = None
    if config.byzantine_towers:  # first, so that its `unscale` is the last applied
        byzantine = ByzantineTowers(
            attack, config.byzantine_towers, config.byzantine_choice, config.seed,
            replicas.global_step, first_tower, replicas.num_towers * replicas.num_workers,
            aggregation.devices.host, _towers_per_node(aggregation), classes,
            replicas.tower_devices)
        common.append(byzantine)
    loss_scaling = precision.uses_loss_scaling(config.mixed_precision)
    if loss_scaling:
        scales = [precision.DynamicLossScale(c.optimizer, c.device) for c in replicas.copies]
        common.append(LossScaling(scales, aggregation, units,
                                  [0] if single_loss else
                                  [replicas.copy_index(t) for t in range(len(units))],
                                  [c.device for c in replicas.copies]))
    if config.batch_norm == "sync" and replicas.num_towers > 1:
        common.append(SyncBatchNorm(replicas.tower_devices))
        sync_batch_norm.install(model)
    if config.histogram_every > 0:
        common.append(KeepLastGradients(replicas.copies[0]))
    failures = aggregation.failure_schedule()
    common += [node_failures_hook(failures, replicas)] if failures else []  # down: frozen
    common += [h for h in [inner_turns_hook(replicas)] if h]  # async_diloco's clock
    common += list(hooks)
    if replicas.towers_per_device > 1:
        vectorized_towers.check_hooks(common)
    return CommonHooks(common, units, byzantine, loss_scaling, failures)


def compiled_pass(config: Config, common: list):
    """--xla_towers: a tower's pass as one compiled function (its hooks checked), else None."""
    compiled = None
    if config.xla_towers:
        compiled_towers.check_hooks(common)
        compiled = compiled_towers.CompiledPass()
    return compiled


def micro_batch_passes(config: Config, replicas: Replicas, units: list, metrics: list):
    """One pass per step, or --accumulation_steps passes summed (accumulation.py)."""
    return (accumulation.one_pass if config.accumulation_steps == 1 else
            accumulation.Accumulate(config.accumulation_steps, replicas.copies[0].trainable,
                                    units, metrics_lib.total_size(metrics),
                                    replicas.aggregation.traffic))


@dataclasses.dataclass(frozen=True)
class StepParts:
    """What a step is made of, whichever kind it is."""

    replicas: Replicas
    loss_fn: Callable
    metrics: list
    common: CommonHooks
    passes: object  # accumulation.one_pass or an Accumulate
    streams: random_streams_lib.RandomStreams
    compiled: object  # compiled_towers.CompiledPass or None


def single_loss_loop(config: Config, parts: StepParts, staging) -> tuple:
    """(the SingleLossStep, its loop): one loss and one gradient, none per tower."""
    if config.diagnostics:
        logging.info("--aggregation=%s computes one loss and one gradient, none per tower: "
                     "no per-tower diagnostics are written", config.aggregation)
    step = SingleLossStep(parts.replicas, parts.loss_fn, parts.metrics,
                          Hooks(parts.common.hooks), parts.passes, parts.streams)
    return step, loop.Loop(step, staging, parts.metrics)


def tower_loop(config: Config, parts: StepParts, staging) -> tuple:
    """(the TowerStep, its loop): the large-gradient hooks where they apply, the exchange,
    and with --diagnostics the same step with its statistics added (sampled by the loop)."""
    replicas, loss_fn, metrics = parts.replicas, parts.loss_fn, parts.metrics
    common, passes, streams = parts.common.hooks, parts.passes, parts.streams
    aggregation = replicas.aggregation
    average = config.grad_reduce == "mean"
    large = large_gradient_hooks(config, replicas, parts.common.loss_scaling)
    factors = next((h for h in large if isinstance(h, SufficientFactorsHook)), None)
    step_hooks = Hooks(common + large, factors.gradients if factors else tape_gradients)
    step = TowerStep(replicas, loss_fn, metrics, step_hooks, passes,
                     exchange_lib.make(aggregation, replicas.copies, average,
                                       config.pack_bytes, bool(large),
                                       config.sparse_as_dense,
                                       replicas.update if config.shard_update else None),
                     streams, parts.compiled)
    sampled, names = None, []
    if config.diagnostics:  # the same step, its statistics added (and sampled)
        stats = GradientStats(replicas.tower_devices, aggregation.devices.host,
                              replicas.copies, leave_out=summed_at_home(large),
                              byzantine=parts.common.byzantine)
        sampled = TowerStep(replicas, loss_fn, metrics,
                            Hooks(common + large + [stats], step_hooks.gradients), passes,
                            step.exchange, streams, parts.compiled)
        names = stats.names
    return step, loop.Loop(step, staging, metrics, sampled, names)


def _towers_per_node(aggregation) -> int:
    """Towers per node when the method is between nodes (simulated, or each worker a node
    inside the cross-worker stage), so that an attacker is a whole node; else 1."""
    return aggregation.towers_per_node()
