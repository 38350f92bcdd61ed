"""The Trainer: builds the towers for an aggregation and runs the compiled loop.

One training step on a global batch (x, y) of B examples and T towers:

    1. the staging (staging.py) hands tower t its contiguous shard t of B/T
       examples, tower 0 first, already on tower t's device;
    2. tower t, on its device, computes loss_t and g[t] on shard t (towers.py);
    3. the aggregation averages: g = (1/T) * sum_t g[t], placed per variable copy;
    4. every variable copy applies g with its own optimizer (optim.py).

The reported loss is (1/T) * sum_t loss_t, the mean loss over the global batch.
Options across modes: --accumulation_steps=K runs steps 1-2 on K micro-batches
and averages g[t] on each tower before one exchange (accumulation.py);
--mixed_precision=mixed_float16 scales each tower's loss and skips the update on
every copy when any tower's gradients are not finite (precision.py);
--batch_norm=sync computes batch statistics over the global batch across the
towers during step 2 (sync_batch_norm.py).
`train_loop` runs up to `num_steps` such steps inside one `tf.function` call (a
`tf.range` loop), so Python runs once per loop, not once per step; the outer
loop (`controller.fit`) chooses loop lengths so that summaries, logs and
checkpoints fall on their step boundaries.

Input wait, per step, is measured inside the compiled loop with `staging.clock()`
(`tf.timestamp`), as the time step t spends on its input beyond its compute:

    wait_t = (ready_t - begin_t) + (end_t - compute_end_t)

begin_t: step t starts (after step t-1 has ended); ready_t: step t's shards
are on every tower; compute_end_t: every variable copy holds step t's update;
end_t: that, and (under `device` staging) the batch of step t+K is staged.
The first term is the time the towers sit idle at the start of step t
because its input is not there (under `none` it is the whole host pipeline
and copy); the second, the time step t is held up after its compute by
staging a later batch. The sum is zero when input is fully hidden behind
compute. Priming the staging areas before a loop counts as wait of that loop.
Evaluation and prediction on the towers: inference.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Iterator

import keras
import tensorflow as tf

from mgloop import accumulation
from mgloop.breakdown import PHASES, STEP_SCOPE  # name scopes by which a profile is read
from mgloop import diagnostics as diagnostics_lib
from mgloop import exchange_timing
from mgloop import inference
from mgloop import losses
from mgloop import model_input
from mgloop import non_trainable
from mgloop import optim
from mgloop import ordered_sum
from mgloop import sufficient_factors
from mgloop import precision
from mgloop import random_streams
from mgloop import sync_batch_norm
from mgloop import staging as staging_lib
from mgloop import towers
from mgloop.aggregation import REPLICATED, Aggregation
from mgloop.aggregation import packing

@dataclasses.dataclass
class LoopResult:
    """What one call of `Trainer.train_loop` did."""

    steps: int  # steps run: fewer than asked when the input ended
    loss_sum: float  # sum over those steps of the mean loss over the global batch
    correct: float  # predictions that were right, over those steps (accuracy.py)
    compared: float  # predictions compared; 0 where the loss defines no accuracy
    input_wait: float  # seconds the towers waited for input, over those steps
    # --diagnostics: the `stat_names` values of the loop's last step, if it was sampled
    stats: dict[str, float] = dataclasses.field(default_factory=dict)


class Trainer(inference.TowerInference):
    """Variable copies, optimizers, input staging and the compiled train/eval steps of one run."""

    def __init__(self, model_fn: Callable[[], keras.Model], loss_fn: towers.LossFn,
                 aggregation: Aggregation, optimizer_fn: Callable[[], keras.optimizers.Optimizer],
                 input_shape: tuple[int, ...] | None = None, grad_reduce: str = "mean",
                 pack_bytes: int = 0, accumulation_steps: int = 1,
                 mixed_precision: str = "none", batch_norm: str = "per_tower",
                 staging: staging_lib.HostStaging | None = None, diagnostics: bool = False,
                 keep_last_grads: bool = False,
                 ordered_sum_bytes: int = ordered_sum.DEFAULT_MIN_BYTES,
                 sufficient_factor_bytes: int = sufficient_factors.DEFAULT_MIN_BYTES):
        self.aggregation = aggregation
        self.tower_devices = list(aggregation.devices.towers)
        self.loss_fn = loss_fn
        self.average = grad_reduce == "mean"
        self.pack_bytes = pack_bytes
        self.accumulation_steps = accumulation_steps
        self.ordered_sum_bytes = ordered_sum_bytes
        self.sufficient_factor_bytes = sufficient_factor_bytes
        self.staging = staging or staging_lib.make("device", 2, self.tower_devices,
                                                   accumulation_steps)
        self._input = None  # the iterator whose batches the staging holds
        with aggregation.variable_scope(), precision.policy_scope(mixed_precision):
            self.model = model_fn()
            if not self.model.built or not self.model.variables:
                self.model(tf.zeros((1, *input_shape)))  # create a lazily built model's variables
        if input_shape is not None:  # before any copy: one line, not a traced traceback
            model_input.check_fits_data(self.model, input_shape)
        self.loss_fn = losses.for_model(loss_fn, self.model, input_shape)  # its output's loss
        self.copies = towers.make_copies(self.model, aggregation.parameter_devices())
        aggregation.build(self.copies[0].trainable)  # the method's own state, once
        # each tower draws its own random numbers (dropout masks), by its global index
        self.random_streams = random_streams.RandomStreams(
            self.model, self.workers.index * self.num_towers if self.workers else 0)
        optim.build_optimizers(self.copies, optimizer_fn)
        self.loss_scales = ([precision.DynamicLossScale(copy.optimizer, copy.device)
                             for copy in self.copies]
                            if precision.uses_loss_scaling(mixed_precision) else None)
        self.cross_tower = None  # --batch_norm=sync: moments over the global batch
        if batch_norm == "sync" and self.num_towers > 1:
            self.cross_tower = sync_batch_norm.CrossTowerMoments(self.tower_devices)
            sync_batch_norm.install(self.model)
        with tf.device(aggregation.devices.host):
            self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")
        # --diagnostics: per-step gradient statistics (diagnostics.py), traced only when on.
        self.stat_names = (diagnostics_lib.stat_names(self.num_towers)
                           if diagnostics and not aggregation.single_loss else [])
        # indices of the trainable variables whose gradients the last traced step summed
        # in tower order (ordered_sum.py) or from their factors (sufficient_factors.py)
        self.large_gradients: dict[str, list[int]] = {"ordered": [], "factored": []}
        self.last_grads = None  # histograms: the gradient copy 0 applied in the last step
        if keep_last_grads:
            with tf.device(self.copies[0].device):
                self.last_grads = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False)
                                   for v in self.copies[0].trainable]

    @property
    def num_towers(self) -> int:
        return len(self.tower_devices)

    def loss_scale(self) -> float | None:
        """The current dynamic loss scale (the same on every copy); None without loss scaling."""
        return float(self.loss_scales[0].scale.numpy()) if self.loss_scales else None

    def sync_replicas(self) -> None:
        """Copies variable copy 0 (e.g. just restored) into every other copy."""
        towers.copy_first_to_rest(self.copies)

    @property
    def workers(self):
        """The cluster of a cross-worker aggregation (aggregation/cross_worker.py), else None."""
        return self.aggregation.cluster

    def broadcast_from_chief(self) -> None:
        """Several processes: every worker takes worker 0's variables, optimizer state and
        step, then copies them into its replicas (run at start, after any restore)."""
        if self.workers is None:
            return
        first = self.copies[0]
        variables = (first.variables + [towers.backing(v) for v in first.optimizer.variables]
                     + [self.global_step] + list(self.aggregation.state_variables))
        tf.function(lambda: self.aggregation.broadcast_from_chief(variables))()
        self.sync_replicas()

    def copy_for_tower(self, tower: int) -> towers.VariableCopy:
        return self.copies[self.copy_index(tower)]

    def copy_index(self, tower: int) -> int:
        return tower if self.aggregation.layout == REPLICATED else 0

    def read_for_tower(self, tower: int) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
        """The (trainable, non-trainable) values tower `tower` computes with, on its device.

        Replicated: its own copy, already there. Shared: copy 0, sent from each
        variable's device (the parameter reads, counted in the traffic).
        """
        device = self.tower_devices[tower]
        copy = self.copy_for_tower(tower)
        values = towers.read(copy.trainable), towers.read(copy.non_trainable)
        if self.aggregation.layout == REPLICATED:
            return values
        variables = copy.trainable, copy.non_trainable
        return tuple([self.aggregation.send(value, v.device, device) for value, v in zip(vals, vs)]
                     for vals, vs in zip(values, variables))

    def exchange(self, tower_grads: list[list[tf.Tensor]], metrics: list[tf.Tensor],
                 sums: dict[int, tf.Tensor] | None = None
                 ) -> tuple[list[list[tf.Tensor]], list[tf.Tensor]]:
        """The aggregation of the towers' gradients (packed into buckets if asked), and this
        process's `metrics` summed over every worker, in the same exchange
        (`Aggregation.reduce_with_metrics`; as given in one process); the variables in
        `sums` already summed over the towers at their homes (ordered_sum.py,
        sufficient_factors.py; one process only), only scaled."""
        variables = self.copies[0].trainable
        if sums:  # the aggregation's metrics come back as given (one process)
            return (ordered_sum.reduce(self.aggregation, tower_grads, variables, sums,
                                       self.average), list(metrics))
        if not self.pack_bytes:
            return self.aggregation.reduce_with_metrics(tower_grads, variables, self.average,
                                                        metrics)
        buckets = packing.plan(tower_grads[0], self.pack_bytes)
        packed = [packing.pack(grads, buckets, device)
                  for grads, device in zip(tower_grads, self.tower_devices)]
        reduced, metrics = self.aggregation.reduce_with_metrics(
            packed, [variables[b[0]] for b in buckets], self.average, metrics)
        shapes = [v.shape for v in variables]
        return [packing.unpack(values, buckets, shapes, copy.device)
                for values, copy in zip(reduced, self.copies)], metrics

    def train_step(self, shards, with_stats: bool = True
                   ) -> tuple[tf.Tensor, tf.Tensor, tf.Operation, tf.Tensor | None]:
        """One synchronous update on per-tower shards (x_t, y_t), each on its tower.

        Returns (mean loss over the step's examples, its accuracy counts [correct,
        compared] (accuracy.py), an op that has
        run once every variable copy holds this step's update, the step's values of
        `stat_names` as one vector on the host: None without --diagnostics or
        `with_stats`, whereupon nothing of them is traced). With
        --accumulation_steps=K a shard holds K micro-shards of B/T examples, micro-
        batch k being the k-th micro-shard of every tower (accumulation.py); the
        loss is the mean over the K micro-batches of their mean loss.
        """
        with self.aggregation.step(), self._cross_tower_step():
            units = ([self.aggregation.devices.host] if self.aggregation.single_loss
                     else self.tower_devices)
            scales = (precision.read_loss_scales(self.loss_scales, self.aggregation, units,
                                                 self.copy_index) if self.loss_scales else None)
            with tf.name_scope(PHASES[1]):  # the towers read what they compute with
                if self.aggregation.single_loss:
                    trainable, states = self._read_for_single_loss()
                else:
                    values = [self.read_for_tower(t) for t in range(self.num_towers)]
                    trainable, states = [v[0] for v in values], [v[1] for v in values]

            sampled = bool(self.stat_names and with_stats)  # needs every tower's gradients

            def micro_pass(micro_xs, micro_ys, tower_states):
                return self._micro_pass(trainable, tower_states, scales, micro_xs, micro_ys,
                                        sampled)

            with tf.name_scope(PHASES[1]):
                result = accumulation.accumulate(
                    micro_pass, [x for x, _ in shards], [y for _, y in shards],
                    self.accumulation_steps, states, self.copies[0].trainable, units)
            finite = (precision.agree_finite(result.grads, units, self.aggregation,
                                             [copy.device for copy in self.copies])
                      if scales else None)
            stats = (diagnostics_lib.gradient_stats(result.losses, result.grads, units,
                                                    self.aggregation.devices.host)
                     if sampled else None)
            with tf.device(self.aggregation.devices.host):  # this worker's towers
                loss = tf.add_n(result.losses) / len(units)
                counts = tf.add_n(result.accuracy_counts)
            with tf.name_scope(PHASES[2]):  # across workers, the metrics ride with the grads
                if self.aggregation.single_loss:
                    grads = [result.grads[0]]
                else:
                    grads, (loss, counts) = self.exchange(result.grads, [loss, counts],
                                                            result.sums)
            if self.last_grads is not None:
                for keep, g in zip(self.last_grads, grads[0]):
                    with tf.device(keep.device):
                        keep.assign(tf.cast(g, keep.dtype))
            with tf.name_scope(PHASES[2]):
                states = non_trainable.combine(self.aggregation, result.states, self.copies,
                                               self.tower_devices)
            with tf.name_scope(PHASES[3]):
                self._apply(grads, states, finite)
        if self.workers is not None:  # the mean over workers of their towers' mean loss
            with tf.device(self.aggregation.devices.host):
                loss = loss / self.workers.num_workers
        with tf.device(self.aggregation.devices.host):
            self.global_step.assign_add(1)
        # Reads are ordered after the writes above (automatic control dependencies).
        done = tf.group([v.value() for copy in self.copies for v in copy.variables]
                        + [self.global_step.value()]
                        + ([v.value() for v in self.last_grads] if self.last_grads else []))
        if stats is not None:
            with tf.control_dependencies([done]):  # after every copy's update
                divergence = diagnostics_lib.replica_divergence(self.copies)
            with tf.device(self.aggregation.devices.host):
                stats = tf.concat([stats, divergence[None]], 0)
        return loss, counts, done, stats

    def _micro_pass(self, trainable, states, scales, xs, ys, sampled: bool = False
                    ) -> accumulation.Pass:
        """Every tower (or the single loss) on one micro-batch, given as per-tower shards
        (xs[t], ys[t]) on the towers; traffic counted per pass. `sampled`: the step
        samples the diagnostics, so every tower's gradients are kept."""
        traffic = self.aggregation.traffic
        before = (dict(traffic.sent), dict(traffic.received))
        streams = self.random_streams
        if self.aggregation.single_loss:
            loss, counts, grads, new_states = self.aggregation.single_loss_step(
                self.model, self.loss_fn, trainable,
                [streams.for_tower(s, t, d) for t, (s, d) in enumerate(zip(states,
                                                                         self.tower_devices))],
                xs, ys, scales[0] if scales else None)
            out = accumulation.Pass([loss], [counts], [grads],
                                    [streams.after_tower(given, new)
                                     for given, new in zip(states, new_states)])
        else:
            outputs = []
            order, factors = self._ordered_sum(sampled), self._sufficient_factors(sampled)
            for t, device in enumerate(self.tower_devices):
                with self._cross_tower_tower(t):
                    outputs.append(towers.tower_step(
                        self.model, self.loss_fn, trainable[t],
                        streams.for_tower(states[t], t, device), xs[t], ys[t], device,
                        scales[t] if scales else None, order.gate() if order else (),
                        factors))
                with tf.name_scope(PHASES[2]):  # the sums' part of the exchange
                    if factors:
                        factors.add(outputs[-1].factors, device)
                    if order:
                        order.add(outputs[-1].grads, device)
            with tf.name_scope(PHASES[2]):
                sums = {**(order.sums if order else {}), **(factors.sums() if factors else {})}
            if not sampled:  # what the ordinary step does with large gradients
                self.large_gradients = {"ordered": sorted(order.sums) if order else [],
                                        "factored": sorted(factors.received) if factors else []}
            out = accumulation.Pass([o.loss for o in outputs],
                                    [o.accuracy_counts for o in outputs],
                                    [o.grads for o in outputs],
                                    [streams.after_tower(given, o.non_trainable)
                                     for given, o in zip(states, outputs)], sums)
        repeats = self.accumulation_steps - 1  # the pass is traced once and runs K times
        for device in (set(traffic.sent) | set(traffic.received)) if repeats else ():
            traffic.add(device,
                        sent=repeats * (traffic.sent.get(device, 0) - before[0].get(device, 0)),
                        received=repeats * (traffic.received.get(device, 0) -
                                            before[1].get(device, 0)))
        return out

    def _sums_at_home(self, sampled: bool) -> bool:
        """Whether the towers' gradients of a variable may be summed at its home as they
        come (ordered_sum.py, sufficient_factors.py): not when every tower's gradients
        must be kept anyway (accumulation sums, the diagnostics' Gram matrix on a
        `sampled` step, packed buckets) nor with synchronised batch norm, whose backward
        passes meet in collectives and so cannot run one after another."""
        return (ordered_sum.applies(self.aggregation) and self.accumulation_steps == 1
                and not sampled and not self.pack_bytes and self.cross_tower is None)

    def _ordered_sum(self, sampled: bool = False) -> ordered_sum.OrderedSum | None:
        """Large gradients summed tower by tower (ordered_sum.py), where that bounds memory."""
        if not self.ordered_sum_bytes or not self._sums_at_home(sampled):
            return None
        order = ordered_sum.OrderedSum(self.aggregation, self.copies[0].trainable,
                                       self.ordered_sum_bytes)
        return order if order.indices else None

    def _sufficient_factors(self, sampled: bool = False
                            ) -> sufficient_factors.SufficientFactors | None:
        """Large dense kernels' gradients as one product of the towers' factors
        (sufficient_factors.py), under the same conditions as the ordered sum."""
        if (not self.sufficient_factor_bytes or not self._sums_at_home(sampled)
                or self.loss_scales):  # the finite check reads every tower's gradients
            return None
        factors = sufficient_factors.SufficientFactors(
            self.aggregation, self.copies[0].trainable, self.sufficient_factor_bytes)
        return factors if factors.candidates else None

    def _read_for_single_loss(self):
        """The shared copy's values on the host, and its state sent to every tower."""
        copy, host = self.copies[0], self.aggregation.devices.host
        trainable, state = towers.read(copy.trainable), towers.read(copy.non_trainable)
        states = [[self.aggregation.send(v, host, device) for v in state]
                  for device in self.tower_devices]
        return trainable, states

    def _apply(self, grads_per_copy, states_per_copy, finite_per_copy) -> None:
        """Each copy applies its gradients and takes its new state (if all towers were finite)."""
        for c, copy in enumerate(self.copies):
            def update(copy=copy, grads=grads_per_copy[c], states=states_per_copy[c]):
                optim.apply_updates([copy], [grads])
                for var, value in zip(copy.non_trainable, states):
                    with tf.device(var.device):
                        var.assign(value)
            if finite_per_copy is None:
                update()
            else:
                self.loss_scales[c].apply_if_finite(finite_per_copy[c], update)

    def _cross_tower_step(self):
        return self.cross_tower.step() if self.cross_tower else contextlib.nullcontext()

    def _cross_tower_tower(self, tower: int):
        return self.cross_tower.tower(tower) if self.cross_tower else contextlib.nullcontext()

    def train_loop(self, iterator: Iterator, num_steps: int,
                   sample_stats: bool = True) -> LoopResult:
        """Up to `num_steps` steps on the iterator's global batches, in one compiled call.

        Fewer steps run only if the iterator ends (then every batch it gave has
        been trained on). Batches staged ahead stay staged for the next call
        with the same iterator; given another iterator, the staging first drops
        what the previous one staged. With --diagnostics and `sample_stats`, the
        gradient statistics are computed on the loop's last step alone (a
        sample, as summaries are: the other steps skip them, so their cost is
        one step's per loop) and returned in `stats`.
        """
        if iterator is not self._input:
            self.staging.clear()
            self._input = iterator
        began = time.perf_counter()
        self.staging.prime(iterator)
        primed = time.perf_counter() - began
        out = self.compiled_loop(iterator, tf.constant(num_steps, tf.int32),
                                 tf.constant(sample_stats and bool(self.stat_names)))
        return LoopResult(steps=int(out["steps"]), loss_sum=float(out["loss_sum"]),
                          correct=float(out["correct"]), compared=float(out["compared"]),
                          input_wait=float(out["input_wait"]) + primed,
                          stats=(dict(zip(self.stat_names, out["stats"].numpy().tolist()))
                                 if bool(out["sampled"]) else {}))

    def release_input(self) -> None:
        """Drops whatever the current iterator has staged (the end of a `fit`)."""
        self.staging.clear()
        self._input = None

    @tf.function
    def compiled_loop(self, iterator: Iterator, num_steps: tf.Tensor,
                      sample_stats: tf.Tensor) -> dict[str, tf.Tensor]:
        """The loop of `train_loop`: sums over the steps run, and their count.

        With `sample_stats` (true only with --diagnostics), the last step runs
        after the `tf.range` loop, traced a second time with the statistics: the
        loop's other steps are exactly the step without them (no per-step cost).
        """
        loss_sum, counts_sum = tf.constant(0.0), tf.zeros([2], tf.float64)  # exact sums
        stats_last, sampled = tf.zeros([len(self.stat_names)]), tf.constant(False)
        steps, wait = tf.constant(0), tf.constant(0.0, tf.float64)
        end = staging_lib.clock()
        for _ in tf.range(num_steps - tf.cast(sample_stats, tf.int32)):
            begin, has_batch, take = self._next_batch(iterator, after=end)
            if not has_batch:
                break
            loss, counts, step_wait, end, _ = self._timed_step(take, begin, with_stats=False)
            wait += step_wait
            loss_sum += loss
            counts_sum += tf.cast(counts, tf.float64)
            steps += 1
        if self.stat_names:  # traced only with --diagnostics
            if sample_stats and steps == num_steps - 1:
                begin, has_batch, take = self._next_batch(iterator, after=end)
                if has_batch:
                    loss, counts, step_wait, end, stats_last = self._timed_step(
                        take, begin, with_stats=True)
                    wait += step_wait
                    loss_sum += loss
                    counts_sum += tf.cast(counts, tf.float64)
                    sampled = tf.constant(True)
                    steps += 1
        return {"steps": steps, "loss_sum": loss_sum, "correct": counts_sum[0],
                "compared": counts_sum[1],
                "input_wait": wait, "stats": stats_last, "sampled": sampled}

    def _next_batch(self, iterator, after: tf.Tensor):
        """(the step's begin time, read once `after` has run; has a batch?; take)."""
        with tf.control_dependencies([after]):
            begin = staging_lib.clock()
        with tf.name_scope(PHASES[0]):
            has_batch, take = self.staging.next_batch(iterator, after=begin)
        return begin, has_batch, take

    def _timed_step(self, take, begin: tf.Tensor, with_stats: bool):
        """One step on the batch `take()` gives, begun at `begin`: (loss, counts, its input
        wait (see the top of this module), its end time, its statistics or None)."""
        with tf.name_scope(STEP_SCOPE):
            with tf.name_scope(PHASES[0]):
                shards, staged = take()
            with tf.control_dependencies([t for shard in shards for t in shard]):
                ready = staging_lib.clock()
            loss, counts, done, stats = self.train_step(shards, with_stats)
            with tf.control_dependencies([done]):
                compute_end = staging_lib.clock()
            with tf.control_dependencies([compute_end] + staged):
                step_end = staging_lib.clock()
            # tf.timestamp reads the wall clock, which the system may set back by a few
            # microseconds between two reads: a term is never less than 0.
            wait = tf.maximum(ready - begin, 0.0) + tf.maximum(step_end - compute_end, 0.0)
            return loss, counts, wait, step_end, stats

    def time_exchange(self, repeats: int = 5, per_call: int = 20) -> float | None:
        """Median seconds of one gradient exchange alone (exchange_timing.py)."""
        return exchange_timing.time_exchange(self, repeats, per_call)
