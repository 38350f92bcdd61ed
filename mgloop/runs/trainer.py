"""The Trainer: one run's parts composed, with the names the rest of mgloop uses.

    replicas   the variable copies, their optimizers, the global step (replicas.py)
    step       the training step with its hooks (step/training_step.py, single_loss_step.py)
    loop       the compiled multi-step loop and its input-wait clock (loop.py)
    inference  evaluate and predict the method's model on the towers (inference.py)
    spec       the loss, metrics and optimizer used, and where each came from
               (training_spec.py)

Built by `assemble.build` (experiment.build_trainer from a Config).
"""

from __future__ import annotations

from mgloop.step import exchange_timing
from mgloop.step.hooks.histograms import KeepLastGradients
from mgloop.step.hooks.large_gradients import OrderedSumHook, SufficientFactorsHook
from mgloop.step.hooks.loss_scaling import LossScaling


class Trainer:
    """`train_loop`: the loop's, or one wrapping it (e.g. one logging node failures as they
    happen: aggregation/placement/node_failures.py)."""

    def __init__(self, replicas, step, loop, inference, random_streams, spec,
                 train_loop=None):
        self.replicas, self.step, self.loop, self.inference = replicas, step, loop, inference
        self.random_streams, self.spec = random_streams, spec  # spec: training_spec.Spec
        # what the rest of mgloop and the tests read
        self.model, self.copies = replicas.model, replicas.copies
        self.aggregation, self.global_step = replicas.aggregation, replicas.global_step
        self.tower_devices, self.num_towers = replicas.tower_devices, replicas.num_towers
        self.loss_fn, self.metrics = step.loss_fn, step.metrics
        self.staging, self.stat_names = loop.staging, loop.stat_names
        self.train_loop = loop.train_loop if train_loop is None else train_loop
        self.release_input = loop.release_input
        self.evaluate, self.predict = inference.evaluate, inference.predict
        self.sync_replicas = replicas.sync_replicas
        self.broadcast_from_chief = replicas.broadcast_from_chief

    def global_model(self):
        """The Keras model holding the model the method produces (aggregation/base.py
        `global_model`), assigned now: the template (copy 0) for a method whose copies are
        equal, else the evaluation copy (inference.py). What is exported and returned."""
        return self.inference.refresh()

    @property
    def evaluated_model(self) -> str:
        """Which model `global_model`, evaluate and predict use, in words."""
        return self.inference.model_name

    @property
    def workers(self):
        return self.replicas.workers

    def loss_scale(self) -> float | None:
        """The current dynamic loss scale (the same on every copy); None without loss scaling."""
        scaling = self.step.hooks.find(LossScaling)
        return scaling.current() if scaling else None

    @property
    def loss_scales(self):
        """Each copy's DynamicLossScale (precision.py), or None without loss scaling."""
        scaling = self.step.hooks.find(LossScaling)
        return scaling.scales if scaling else None

    @property
    def last_grads(self):
        """--histogram_every: the gradient copy 0 applied in the last step, else None."""
        keep = self.step.hooks.find(KeepLastGradients)
        return keep.last_grads if keep else None

    @property
    def large_gradients(self) -> dict[str, list[int]]:
        """Indices of the trainable variables whose gradients the last traced ordinary step
        summed in tower order (ordered_sum.py) or from their factors (sufficient_factors.py)."""
        order = self.step.hooks.find(OrderedSumHook)
        factors = self.step.hooks.find(SufficientFactorsHook)
        return {"ordered": order.summed if order else [],
                "factored": factors.factored if factors else []}

    def time_exchange(self, repeats: int = 5, per_call: int = 20) -> float | None:
        """Median seconds of one exchange alone (exchange_timing.py)."""
        return exchange_timing.time_exchange(self, repeats, per_call)
