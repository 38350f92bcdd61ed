"""The Trainer: builds the towers for an aggregation and runs the compiled loop.

One training step on a global batch (x, y) of B examples and T towers:

    1. split (x, y) on the host into T contiguous shards of B/T, tower 0 first;
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
`train_loop` runs `num_steps` such steps inside one `tf.function` call (a
`tf.range` loop), so Python runs once per loop, not once per step; the outer
loop (`fit`) chooses loop lengths so that summaries, logs and checkpoints fall
on their step boundaries.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Iterator

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from mgloop import accumulation
from mgloop import optim
from mgloop import precision
from mgloop import sync_batch_norm
from mgloop import towers
from mgloop.aggregation import REPLICATED, Aggregation
from mgloop.aggregation import packing
from mgloop.aggregation.base import Traffic


class Trainer:
    """Variable copies, optimizers and the compiled train/eval steps of one run."""

    def __init__(self, model_fn: Callable[[], keras.Model], loss_fn: towers.LossFn,
                 aggregation: Aggregation, optimizer_fn: Callable[[], keras.optimizers.Optimizer],
                 input_shape: tuple[int, ...] | None = None, grad_reduce: str = "mean",
                 pack_bytes: int = 0, accumulation_steps: int = 1,
                 mixed_precision: str = "none", batch_norm: str = "per_tower"):
        self.aggregation = aggregation
        self.tower_devices = list(aggregation.devices.towers)
        self.loss_fn = loss_fn
        self.average = grad_reduce == "mean"
        self.pack_bytes = pack_bytes
        self.accumulation_steps = accumulation_steps
        with aggregation.variable_scope(), precision.policy_scope(mixed_precision):
            self.model = model_fn()
            if not self.model.built or not self.model.variables:
                self.model(tf.zeros((1, *input_shape)))  # create a lazily built model's variables
        self.copies = towers.make_copies(self.model, aggregation.parameter_devices())
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

    @property
    def num_towers(self) -> int:
        return len(self.tower_devices)

    def loss_scale(self) -> float | None:
        """The current dynamic loss scale (the same on every copy); None without loss scaling."""
        return float(self.loss_scales[0].scale.numpy()) if self.loss_scales else None

    def sync_replicas(self) -> None:
        """Copies variable copy 0 (e.g. just restored) into every other copy."""
        towers.copy_first_to_rest(self.copies)

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

    def exchange(self, tower_grads: list[list[tf.Tensor]]) -> list[list[tf.Tensor]]:
        """The aggregation of the towers' gradients, packed into buckets if asked."""
        variables = self.copies[0].trainable
        if not self.pack_bytes:
            return self.aggregation.reduce(tower_grads, variables, self.average)
        buckets = packing.plan(tower_grads[0], self.pack_bytes)
        packed = [packing.pack(grads, buckets, device)
                  for grads, device in zip(tower_grads, self.tower_devices)]
        reduced = self.aggregation.reduce(packed, [variables[b[0]] for b in buckets], self.average)
        shapes = [v.shape for v in variables]
        return [packing.unpack(values, buckets, shapes, copy.device)
                for values, copy in zip(reduced, self.copies)]

    def train_step(self, x: tf.Tensor, y: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """One synchronous update; returns (mean loss over its examples, correct count).

        (x, y) holds the step's examples: one global batch, or with
        --accumulation_steps=K, K consecutive global batches concatenated
        (accumulation.py). The loss is the mean over the K micro-batches of their
        mean loss; the correct count is over all K*B examples.
        """
        with self.aggregation.step(), self._cross_tower_step():
            units = ([self.aggregation.devices.host] if self.aggregation.single_loss
                     else self.tower_devices)
            scales = self._loss_scales_for(units)
            if self.aggregation.single_loss:
                trainable, states = self._read_for_single_loss()
            else:
                values = [self.read_for_tower(t) for t in range(self.num_towers)]
                trainable, states = [v[0] for v in values], [v[1] for v in values]

            def micro_pass(micro_x, micro_y, tower_states):
                return self._micro_pass(trainable, tower_states, scales, micro_x, micro_y)

            result = accumulation.accumulate(micro_pass, x, y, self.accumulation_steps, states,
                                             self.copies[0].trainable, units)
            finite = self._agree_finite(result.grads, units) if scales else None
            grads = ([result.grads[0]] if self.aggregation.single_loss
                     else self.exchange(result.grads))
            self._apply(grads, self._reduce_non_trainable(result.states), finite)
            with tf.device(self.aggregation.devices.host):
                loss = tf.add_n(result.losses) / len(units)
                correct = tf.add_n(result.corrects)
        with tf.device(self.aggregation.devices.host):
            self.global_step.assign_add(1)
        return loss, correct

    def _micro_pass(self, trainable, states, scales, x, y) -> accumulation.Pass:
        """Every tower (or the single loss) on one global batch; traffic counted per pass."""
        traffic = self.aggregation.traffic
        before = (dict(traffic.sent), dict(traffic.received))
        xs, ys = tf.split(x, self.num_towers), tf.split(y, self.num_towers)
        if self.aggregation.single_loss:
            loss, correct, grads, new_states = self.aggregation.single_loss_step(
                self.model, self.loss_fn, trainable, states, xs, ys,
                scales[0] if scales else None)
            out = accumulation.Pass([loss], [correct], [grads], new_states)
        else:
            outputs = []
            for t, device in enumerate(self.tower_devices):
                with self._cross_tower_tower(t):
                    outputs.append(towers.tower_step(
                        self.model, self.loss_fn, trainable[t], states[t], xs[t], ys[t], device,
                        scales[t] if scales else None))
            out = accumulation.Pass([o.loss for o in outputs], [o.correct for o in outputs],
                                    [o.grads for o in outputs],
                                    [o.non_trainable for o in outputs])
        repeats = self.accumulation_steps - 1  # the pass is traced once and runs K times
        for device in (set(traffic.sent) | set(traffic.received)) if repeats else ():
            traffic.add(device,
                        sent=repeats * (traffic.sent.get(device, 0) - before[0].get(device, 0)),
                        received=repeats * (traffic.received.get(device, 0) -
                                            before[1].get(device, 0)))
        return out

    def _read_for_single_loss(self):
        """The shared copy's values on the host, and its state sent to every tower."""
        copy, host = self.copies[0], self.aggregation.devices.host
        trainable, state = towers.read(copy.trainable), towers.read(copy.non_trainable)
        states = [[self.aggregation.send(v, host, device) for v in state]
                  for device in self.tower_devices]
        return trainable, states

    def _loss_scales_for(self, units: list[str]) -> list[tf.Tensor] | None:
        """Each unit's loss scale, read from the copy it computes with, on its device."""
        if not self.loss_scales:
            return None
        scales = []
        for t, device in enumerate(units):
            source = self.loss_scales[self.copy_index(t)]
            scales.append(self.aggregation.send(source.read(), source.device, device))
        return scales

    def _agree_finite(self, unit_grads, units: list[str]) -> list[tf.Tensor]:
        """AND over units of "all my gradients are finite", formed on the host, sent to
        every copy: one unit's overflow skips the update on every copy."""
        host = self.aggregation.devices.host
        flags = []
        for grads, device in zip(unit_grads, units):
            with tf.device(device):
                flag = precision.all_finite(grads)
            flags.append(self.aggregation.send(flag, device, host))
        with tf.device(host):
            agreed = tf.reduce_all(tf.stack(flags))
        return [self.aggregation.send(agreed, host, copy.device) for copy in self.copies]

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

    def _reduce_non_trainable(self, states: list[list[tf.Tensor]]) -> list[list[tf.Tensor]]:
        """Per copy, its new non-trainable values: float state (moving statistics) averaged
        over towers; other state tower 0's."""
        if not self.copies[0].non_trainable:
            return [[] for _ in self.copies]
        is_float = [v.dtype.is_floating for v in self.copies[0].non_trainable]
        floats = [[s for s, f in zip(state, is_float) if f] for state in states]
        float_vars = [v for v, f in zip(self.copies[0].non_trainable, is_float) if f]
        averaged = (self.aggregation.reduce(floats, float_vars) if float_vars
                    else [[] for _ in self.copies])
        per_copy = []
        for copy, mean in zip(self.copies, averaged):
            mean = iter(mean)
            per_copy.append([next(mean) if f else first for first, f in zip(states[0], is_float)])
        return per_copy

    def _cross_tower_step(self):
        return self.cross_tower.step() if self.cross_tower else contextlib.nullcontext()

    def _cross_tower_tower(self, tower: int):
        return self.cross_tower.tower(tower) if self.cross_tower else contextlib.nullcontext()

    @tf.function
    def train_loop(self, iterator: Iterator, num_steps: tf.Tensor):
        """`num_steps` steps in one call; returns (sum of step losses, sum of correct)."""
        loss_sum, correct_sum = tf.constant(0.0), tf.constant(0.0)
        for _ in tf.range(num_steps):
            x, y = next(iterator)
            loss, correct = self.train_step(x, y)
            loss_sum += loss
            correct_sum += correct
        return loss_sum, correct_sum

    @tf.function
    def _exchange_only(self, tower_grads, repeats):
        """`repeats` exchanges of the given per-tower gradients in one call (nothing else)."""
        done = tf.constant(0)
        for _ in tf.range(repeats):
            with tf.control_dependencies(tf.nest.flatten(self.exchange(tower_grads))):
                done += 1
        return done

    def time_exchange(self, repeats: int = 5, per_call: int = 20) -> float | None:
        """Median seconds of one gradient exchange alone (no tower compute, no update).

        The exchange runs inside the compiled step, where Python cannot time it;
        this runs the same exchange by itself on stand-in gradients, `per_call`
        times inside one compiled call (so the call's own overhead is shared),
        and returns the median over `repeats` calls of call time / per_call.
        None for a single-loss mode, which has no exchange of its own.
        """
        if self.aggregation.single_loss:
            return None
        stand_ins = []  # random gradients, made once on each tower (not timed)
        for device in self.tower_devices:
            with tf.device(device):
                stand_ins.append([tf.random.normal(v.shape, dtype=v.dtype)
                                  for v in self.copies[0].trainable])
        counted = Traffic(dict(self.aggregation.traffic.sent),
                          dict(self.aggregation.traffic.received))
        per_call = tf.constant(per_call)
        int(self._exchange_only(stand_ins, per_call))  # trace and warm up
        self.aggregation.traffic = counted  # keep the step's counts, not the stand-in's
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            int(self._exchange_only(stand_ins, per_call))
            times.append((time.perf_counter() - began) / int(per_call))
        return float(np.median(times))

    @tf.function
    def _eval_step(self, x, y):
        with tf.device(self.copies[0].device):
            logits = self.model(x, training=False)
            losses = self.loss_fn(y, logits)
            loss_sum = tf.reduce_mean(losses) * tf.cast(tf.shape(y)[0], tf.float32)
            return loss_sum, towers.count_correct(y, logits)

    def evaluate(self, batches: tf.data.Dataset) -> dict[str, float]:
        """Mean loss and accuracy of the template model over every example of `batches`."""
        loss_sum = correct = count = 0.0
        for x, y in batches:
            batch_loss, batch_correct = self._eval_step(x, y)
            loss_sum += float(batch_loss)
            correct += float(batch_correct)
            count += int(y.shape[0])
        return {"loss": loss_sum / count, "accuracy": correct / count}


@dataclasses.dataclass
class Window:
    """Running sums of a metric window (since the last summary or log line)."""

    steps: int = 0
    loss_sum: float = 0.0
    correct: float = 0.0
    seconds: float = 0.0

    def add(self, steps, loss_sum, correct, seconds):
        self.steps += steps
        self.loss_sum += loss_sum
        self.correct += correct
        self.seconds += seconds

    def means(self, global_batch: int) -> dict[str, float]:
        return {"loss": self.loss_sum / self.steps,
                "accuracy": self.correct / (self.steps * global_batch),
                "examples_per_sec": self.steps * global_batch / self.seconds,
                "step_time": self.seconds / self.steps}


@dataclasses.dataclass
class FitResult:
    start_step: int
    final_step: int
    train: dict[str, float]  # metrics of the last window
    median_step_time: float | None  # seconds, over loops after the first (tracing) one
    examples_per_sec: float | None  # over loops after the first one
    loop_seconds: float  # all loops, tracing included


def _next_boundary(step: int, every: int) -> int | None:
    return (step // every + 1) * every if every > 0 else None


def fit(trainer: Trainer, batches: tf.data.Dataset, train_steps: int, global_batch: int,
        steps_per_loop: int, summary_every: int = 0, log_every: int = 0,
        checkpoint_every: int = 0, summaries=None, checkpointer=None,
        learning_rate: Callable[[int], float] | None = None) -> FitResult:
    """Runs `trainer` from its current step to `train_steps`.

    Summaries (`summaries.scalars(step, dict)`), log lines and checkpoints
    (`checkpointer.save(step)`) are injected; each falls on multiples of its
    interval (0 = never), and a checkpoint is always written at the end.
    """
    start = step = int(trainer.global_step.numpy())
    iterator = iter(batches)
    summary_window, log_window, last = Window(), Window(), Window()
    per_step_times, steady_steps, steady_seconds = [], 0, 0.0
    loop_seconds, first_loop = 0.0, True
    while step < train_steps:
        stops = [train_steps, step + steps_per_loop] + [
            b for b in (_next_boundary(step, summary_every), _next_boundary(step, log_every),
                        _next_boundary(step, checkpoint_every)) if b is not None]
        num = min(stops) - step
        began = time.perf_counter()
        loss_sum, correct = trainer.train_loop(iterator, tf.constant(num, tf.int32))
        loss_sum, correct = float(loss_sum), float(correct)
        seconds = time.perf_counter() - began
        loop_seconds += seconds
        if not first_loop:  # the first loop includes tracing
            per_step_times.append(seconds / num)
            steady_steps += num
            steady_seconds += seconds
        first_loop = False
        step += num
        if not np.isfinite(loss_sum):
            raise FloatingPointError(f"loss is {loss_sum} at step {step}")
        for window in (summary_window, log_window):
            window.add(num, loss_sum, correct, seconds)
        last = Window(num, loss_sum, correct, seconds)
        if summaries is not None and summary_every and step % summary_every == 0:
            metrics = summary_window.means(global_batch)
            if learning_rate is not None:
                metrics["learning_rate"] = learning_rate(step)
            summaries.scalars(step, metrics)
            summary_window = Window()
        if log_every and (step % log_every == 0 or step == train_steps):
            metrics = log_window.means(global_batch)
            eta = (train_steps - step) * metrics["step_time"]
            logging.info("step %d/%d  loss %.4f  accuracy %.3f  %.0f examples/sec  ETA %.0fs",
                         step, train_steps, metrics["loss"], metrics["accuracy"],
                         metrics["examples_per_sec"], eta)
            log_window = Window()
        if checkpointer is not None and checkpoint_every and step % checkpoint_every == 0:
            checkpointer.save(step)
    if checkpointer is not None and step > start and not (
            checkpoint_every and step % checkpoint_every == 0):
        checkpointer.save(step)
    median_step = None
    if per_step_times:
        median_step = float(np.median(per_step_times))
    elif last.steps:
        median_step = last.seconds / last.steps
    return FitResult(
        start_step=start, final_step=step,
        train=last.means(global_batch) if last.steps else {},
        median_step_time=median_step,
        examples_per_sec=(steady_steps * global_batch / steady_seconds) if steady_steps else None,
        loop_seconds=loop_seconds)
