"""The training step: one synchronous update of every variable copy on one global batch.

`TowerStep` is the tower loop's step; `SingleLossStep` (single_loss_step.py), the
`colocate` baseline's, is its own kind of step beside it. Both take per-tower shards
(x_t, y_t) from the staging (x and y nested structures: a tensor, a tuple, a dict;
every leaf split along the batch dimension) and return a `StepResult`. What options
change is in the step's `hooks` (hooks/__init__.py), its `passes` (one pass, or
accumulation over K micro-batches) and its `exchange` (exchange.py), chosen when the
step is assembled (assemble.py): the step itself has no branch on an option.
"""

from __future__ import annotations

import dataclasses
import functools

import tensorflow as tf

from mgloop.phases import AGGREGATION, APPLY, COMPUTE
from mgloop.step import non_trainable
from mgloop.step import per_tower
from mgloop.step import vectorized_towers
from mgloop.step.accumulation import Pass


@dataclasses.dataclass
class StepResult:
    loss: tf.Tensor  # mean loss over the global batch (every worker's)
    metric_state: tf.Tensor  # float32 [M]: the metrics' states summed over every tower
    done: tf.Operation  # has run once every copy holds this step's update
    report: dict[str, tf.Tensor]  # what hooks add (the sampled step: "stats")


class TowerStep:
    def __init__(self, replicas, loss_fn, metrics, hooks, passes, exchange, random_streams,
                 compiled=None):
        self.replicas, self.loss_fn, self.metrics = replicas, loss_fn, list(metrics)
        self.hooks, self.passes, self.exchange = hooks, passes, exchange
        self.random_streams = random_streams
        # the towers computed together (one device's K), and how: one pass traced once and
        # called on every tower (per_tower.SharedPass) unless a hook acts inside a tower's
        # pass (then one traced pass per tower), one vectorized computation per device
        # (vectorized_towers.py), or one XLA-compiled pass per tower (`compiled`:
        # compiled_towers.CompiledPass, --xla_towers)
        k = replicas.towers_per_device
        self.groups = [range(t, t + k) for t in range(0, replicas.num_towers, k)]
        self.group_pass = (compiled or per_tower.tower_loop_pass(hooks) if k == 1
                           else vectorized_towers.device_pass)
        self.tower_outputs: list[per_tower.TowerOutput] = []  # of the last trace (exchange_timing)

    def __call__(self, shards) -> StepResult:
        """One step on shards[t] = (x_t, y_t), each on tower t's device (T towers, W workers):

        1. tower t reads the values of its variable copy (shared: copy 0, sent to it);
        2. tower t computes, on its device, loss_t = mean loss over its shard and
           g[t] = d loss_t / d v (per_tower.tower_pass; with K micro-batches, the mean of K),
           then the hooks' `alter_towers` of every g[t] (an omniscient attack);
        3. the exchange forms g = (1/T) sum_t g[t] over every worker's towers, placed per
           copy (sums already formed at home are only scaled), with the step's metrics
           and the hooks' counts (`to_all_workers`: loss scaling's overflows), summed
           over the workers;
        4. every copy applies g with its own optimizer and takes the towers' averaged
           non-trainable state (non_trainable.py), if the hooks' guard lets it; then the
           method's `after_update` (a no-op for synchronous methods; local SGD and DiLoCo
           average the parameters there every H steps);
        5. the global step advances.

        loss = (1/(W T)) sum_{w,t} loss_t; metric_state = sum over every tower of its
        metrics' states (metrics.py).
        """
        replicas, hooks, aggregation = self.replicas, self.hooks, self.replicas.aggregation
        with aggregation.step(), hooks.step_scope():
            with tf.name_scope(COMPUTE):  # 1. the towers read their parameters
                reads = replicas.read_for_towers(self.groups)
                trainable = [values for values, _ in reads]
            with tf.name_scope(COMPUTE):  # 2. forward, loss and backward on every shard
                out = self.passes(functools.partial(self.towers_pass, trainable),
                                  [x for x, _ in shards], [y for _, y in shards],
                                  [state for _, state in reads])
            sent = hooks.alter_towers(out.grads)  # what every tower hands the exchange
            hooks.observe(out.losses, sent)
            may_apply = hooks.may_apply(sent)
            with tf.device(aggregation.devices.host):  # this worker's share of the means
                loss = tf.add_n(out.losses) / (replicas.num_towers * replicas.num_workers)
                metric_state = tf.add_n(out.metric_states)
            with tf.name_scope(AGGREGATION):  # 3. the exchange (metrics ride with the grads,
                # and the hooks' counts with them: summed over the workers, e.g. the overflows)
                grads, summed = self.exchange(sent, [loss, metric_state,
                                                     *hooks.to_all_workers()], out.sums)
                loss, metric_state = summed[:2]
                hooks.from_all_workers(summed[2:])
                kept = hooks.after_exchange(grads)
                states = non_trainable.combine(aggregation, out.states, replicas.copies,
                                               replicas.tower_devices)
            with tf.name_scope(APPLY):  # 4. every copy applies the update, then the method's
                replicas.apply(grads, states, may_apply)  # own step after it (averaging)
                kept += aggregation.after_update(replicas.copies)
        done = replicas.advance(also=kept)  # 5. the step advances
        return StepResult(loss, metric_state, done, hooks.report(done))

    def towers_pass(self, trainable, xs, ys, states) -> Pass:
        """Every tower on its shard (xs[t], ys[t]), in tower order, a group (one device's
        towers) at a time; after each, the hooks' `after_tower` (large gradients sent home
        and summed there, in the exchange's scope)."""
        outputs = []
        for group in self.groups:
            computed = self.group_pass(self, group, trainable[group[0]],
                                       [states[t] for t in group], [xs[t] for t in group],
                                       [ys[t] for t in group])
            for t, out in zip(group, computed):
                outputs.append(out)
                with tf.name_scope(AGGREGATION):
                    self.hooks.after_tower(t, out)
        with tf.name_scope(AGGREGATION):
            sums = self.hooks.home_sums()
        self.tower_outputs = outputs
        return Pass([o.loss for o in outputs], [o.metric_state for o in outputs],
                    [o.grads for o in outputs], [o.non_trainable for o in outputs], sums)

    def exchange_alone(self, tower_outputs, metrics):
        """The part of a step from the towers' outputs to each copy's gradients: the hooks'
        `after_tower` and `home_sums`, then the exchange (what exchange_timing.py times)."""
        with self.hooks.step_scope():
            for t, out in enumerate(tower_outputs):
                self.hooks.after_tower(t, out)
            sums = self.hooks.home_sums()
            return self.exchange([o.grads for o in tower_outputs], metrics, sums)
