"""Evaluation and prediction on the towers (composed into the `Trainer`).

Evaluation and prediction split each batch of n examples over the towers in
contiguous uneven shards, tower 0 first: with a = min(n, T) towers in use,
tower t < a gets floor(n/a) examples plus one if t < n mod a, so a final batch
smaller than the tower count works. Eval sums per-example losses (a tower's
mean loss times its example count) over all towers and batches and divides
by the example count; each metric sums the towers' states (metrics.py; accuracy:
[correct, compared], accuracy.py) and takes its value from the sums: the
single-device answers. A metric undefined on what was seen is left out.

The model evaluated is the one the method produces (`Aggregation.global_model`), on every
tower: copy 0 (the template) for a method whose copies are equal; for one whose copies
differ between its synchronisations (`copies_differ`: local SGD, the DiLoCo family, SPARTA)
an evaluation copy, a second model of the template's architecture on copy 0's device
(`evaluation_model`), assigned the method's model before each evaluation or prediction
(`refresh`) and read by every tower. No training variable is written: a run's trajectory
is the same bits whatever its eval interval. The export and `RunResult.model` are `model`
(refreshed) too.
"""

from __future__ import annotations

import random

import keras
import numpy as np
import tensorflow as tf

from mgloop.errors import ConfigError
from mgloop.runs.loop import tensor_branches_refused
from mgloop.training import metrics as metrics_lib
from mgloop.step import per_tower, precision
from mgloop.training.variables import backing


def uneven_shard_sizes(n: tf.Tensor, active: int) -> list[tf.Tensor]:
    """Contiguous shard sizes of n examples over `active` towers, differing by at most one."""
    base, extra = n // active, n % active
    return [base + tf.cast(t < extra, n.dtype) for t in range(active)]


def _batch_size(structure) -> int:
    return int(tf.nest.flatten(structure)[0].shape[0])


def _split(structure, sizes, active: int) -> list:
    """Each leaf of a nested batch split into `active` contiguous shards of `sizes`."""
    if active == 1:
        return [structure]
    parts = [tf.split(leaf, tf.stack(sizes), num=active) for leaf in tf.nest.flatten(structure)]
    return [tf.nest.pack_sequence_as(structure, [p[t] for p in parts]) for t in range(active)]


def _any_size(batch):
    """The specs of `batch`'s tensors with their batch dimension unknown."""
    return tf.nest.map_structure(
        lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), batch)


def evaluation_model(template: keras.Model, model_fn, aggregation, input_shape,
                     mixed_precision: str) -> keras.Model | None:
    """The evaluation copy of a method whose copies differ (`copies_differ`; else None: the
    template is the method's model): a second model of the template's architecture, made
    where the template is (the method's variable scope, the precision policy) by
    `keras.models.clone_model`, or by `model_fn` where the template cannot be cloned (a
    subclassed model without a config); its values are assigned before use (`refresh`).
    Python's and NumPy's random states are kept as they were (Keras draws its initializers'
    seeds from Python's), so a run's later draws do not depend on it."""
    if not aggregation.capabilities.copies_differ:
        return None
    states = random.getstate(), np.random.get_state()
    try:
        with aggregation.variable_scope(), precision.policy_scope(mixed_precision):
            try:
                model = keras.models.clone_model(template)
            except Exception:  # noqa: BLE001 (Keras raises several kinds): rebuild it
                model = model_fn()
            if not model.built or not model.variables:
                model(tf.zeros((1, *input_shape)))
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
    shapes = lambda m: [(tuple(v.shape), v.dtype) for v in m.variables]  # noqa: E731
    if model is template or shapes(model) != shapes(template):
        raise ConfigError(
            f"--aggregation={aggregation.name} evaluates the model it produces in a second "
            "model of the template's architecture, and neither keras.models.clone_model nor "
            "model_fn made one (model_fn must build a new model on each call)")
    return model


class TowerInference:
    """evaluate/predict of the method's model (module top) on the towers, with the
    training's loss and metrics (metrics.py). `evaluated`: the evaluation copy
    (`evaluation_model`), or None when the method's model is copy 0 (the template)."""

    def __init__(self, replicas, loss_fn, metrics, evaluated: keras.Model | None = None):
        self.replicas, self.loss_fn, self.metrics = replicas, loss_fn, list(metrics)
        self.evaluated = evaluated
        self._any_batch_size = set()  # the `active` counts traced for any batch size

    @property
    def model(self) -> keras.Model:
        """The Keras model holding the method's model once `refresh`ed: the evaluation copy,
        or the template."""
        return self.replicas.model if self.evaluated is None else self.evaluated

    @property
    def model_name(self) -> str:
        """Which model is evaluated, in words (summary.json's "evaluated_model")."""
        return self.replicas.aggregation.global_model_name()

    def refresh(self) -> keras.Model:
        """Assigns the method's model to the evaluation copy (trainable: `global_model` of
        every copy; non-trainable: copy 0's, which every copy shares); writes no training
        variable. Returns `model`."""
        if self.evaluated is not None:
            with tensor_branches_refused():
                self._assign()
        return self.model

    @tf.function(autograph=False)  # as the step (loop.py)
    def _assign(self, node=None):
        """The evaluation copy takes the method's model (node None) or node `node`'s own
        copy (`evaluate_nodes`), with copy 0's non-trainable state (node's own: its)."""
        copies = self.replicas.copies
        aggregation = self.replicas.aggregation
        if node is None:
            values, states = aggregation.global_model(copies), list(copies[0].non_trainable)
        else:
            own = aggregation.node_copies(copies)[node]
            values, states = list(own.trainable), list(own.non_trainable)
        targets = [backing(v) for v in (self.evaluated.trainable_variables
                                        + self.evaluated.non_trainable_variables)]
        for target, value in zip(targets, list(values) + states, strict=True):
            with tf.device(target.device):
                target.assign(tf.cast(value, target.dtype))

    def evaluate_nodes(self, batches: tf.data.Dataset) -> dict[str, float]:
        """--eval_each_node, a diagnostic beside the method's model: every node's own copy
        evaluated as `evaluate` does, {"node_n/loss", "node_n/NAME", ...}, and the spread
        between the replicas, "node_spread/loss" = max_n - min_n of the nodes' losses.
        Nothing (an empty dict) for a method whose copies are equal."""
        if self.evaluated is None:
            return {}
        count = len(self.replicas.aggregation.node_copies(self.replicas.copies))
        out, losses = {}, []
        try:
            for n in range(count):
                with tensor_branches_refused():
                    self._assign(n)
                metrics = self._evaluate(batches)
                losses.append(metrics["loss"])
                out.update({f"node_{n}/{k}": v for k, v in metrics.items()})
        finally:
            self.refresh()  # the evaluation copy holds the method's model again
        out["node_spread/loss"] = max(losses) - min(losses)
        return out

    def _tower_outputs(self, x, active: int) -> list[tuple[tf.Tensor, tf.Tensor]]:
        """Inference outputs of x split over the first `active` devices' first towers (with
        --towers_per_device=K one per device: inference has no per-tower statistics or
        random draws to keep apart), each computed with the values of `model` (the method's
        model, read once where it lives): [(rows, outputs)]."""
        model, devices = self.model, self._devices()
        trainable = per_tower.read([backing(v) for v in model.trainable_variables])
        non_trainable = per_tower.read([backing(v) for v in model.non_trainable_variables])
        sizes = uneven_shard_sizes(tf.shape(tf.nest.flatten(x)[0])[0], active)
        shards = _split(x, sizes, active)
        kwargs = per_tower.call_kwargs(model, training=False)
        results = []
        for t, x_t in enumerate(shards):
            with tf.device(devices[t]):
                outputs, _ = model.stateless_call(
                    [tf.identity(v) for v in trainable],
                    [tf.identity(v) for v in non_trainable],
                    tf.nest.map_structure(tf.identity, x_t), **kwargs)
            results.append((sizes[t], outputs))
        return results

    @tf.function(reduce_retracing=True, autograph=False)  # as the step (loop.py)
    def _eval_batch(self, x, y, active: int):
        """(sum of per-example losses, the metrics' states summed over the towers) over one
        batch, on `active` towers."""
        results = self._tower_outputs(x, active)
        sizes = [size for size, _ in results]
        ys = _split(y, sizes, active)
        loss_sums, states = [], []
        for t, ((size, outputs), y_t) in enumerate(zip(results, ys)):
            with tf.device(self._devices()[t]):
                mean = tf.reduce_mean(self.loss_fn(y_t, outputs))
                loss_sums.append(mean * tf.cast(size, mean.dtype))
                states.append(metrics_lib.state(self.metrics, y_t, outputs))
        with tf.device(self.replicas.aggregation.devices.host):
            return tf.add_n(loss_sums), tf.add_n(states)

    @tf.function(reduce_retracing=True, autograph=False)  # as the step (loop.py)
    def _predict_batch(self, x, active: int):
        outputs = [out for _, out in self._tower_outputs(x, active)]
        with tf.device(self.replicas.aggregation.devices.host):
            return tf.nest.map_structure(lambda *o: tf.concat(o, axis=0), *outputs)

    def _devices(self) -> list[str]:
        return self.replicas.tower_devices[::self.replicas.towers_per_device]

    def _active_towers(self, batch_size: int) -> int:
        return max(1, min(batch_size, len(self._devices())))

    def evaluate(self, batches: tf.data.Dataset) -> dict[str, float]:
        """Mean loss and the metrics of the method's model (module top) over every example of
        `batches`, computed on the towers.

        loss = (1/N) * sum over examples of the per-example loss (a tower's mean
        loss times its example count); each metric from its states summed over every
        tower and batch (e.g. accuracy = correct / compared, accuracy.py), a key only
        where it is defined.
        """
        self.refresh()
        return self._evaluate(batches)

    def _evaluate(self, batches: tf.data.Dataset) -> dict[str, float]:
        """`evaluate` of the values `model` holds now."""
        loss_sum, count = 0.0, 0
        state_sum = np.zeros([metrics_lib.total_size(self.metrics)], np.float64)
        for x, y in batches:
            n = _batch_size(y)
            active = self._active_towers(n)
            with tensor_branches_refused():
                if active not in self._any_batch_size:  # one trace for a set's full batches
                    self._any_batch_size.add(active)  # and its last, shorter one
                    self._eval_batch.get_concrete_function(*_any_size((x, y)), active)
                batch_loss, batch_state = self._eval_batch(x, y, active)
            loss_sum += float(batch_loss)
            state_sum += batch_state.numpy()
            count += n
        if not count:
            raise ValueError("evaluate() was given no examples; give at least one")
        return {"loss": loss_sum / count,
                **metrics_lib.results(self.metrics, metrics_lib.split(self.metrics, state_sum))}

    def predict(self, inputs, batch_size: int | None = None) -> np.ndarray:
        """The method's model's outputs (inference mode) for every example, in input order,
        on the towers.

        `inputs`: a tf.data.Dataset of batches (x, or tuples whose first item is
        x), or an array of examples with `batch_size`.
        """
        if not isinstance(inputs, tf.data.Dataset):
            if batch_size is None:
                raise ValueError("predict() on an array needs batch_size")
            inputs = tf.data.Dataset.from_tensor_slices(inputs).batch(batch_size)
        self.refresh()
        outputs = []
        for batch in inputs:
            x = batch[0] if isinstance(batch, (tuple, list)) else batch
            active = self._active_towers(_batch_size(x))
            with tensor_branches_refused():
                predicted = self._predict_batch(x, active)
            outputs.append(tf.nest.map_structure(lambda o: o.numpy(), predicted))
        return tf.nest.map_structure(lambda *o: np.concatenate(o, axis=0), *outputs)
