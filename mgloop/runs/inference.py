"""Evaluation and prediction on the towers (composed into the `Trainer`).

Evaluation and prediction split each batch of n examples over the towers in
contiguous uneven shards, tower 0 first: with a = min(n, T) towers in use,
tower t < a gets floor(n/a) examples plus one if t < n mod a, so a final batch
smaller than the tower count works. Eval sums per-example losses (a tower's
mean loss times its example count) over all towers and batches and divides
by the example count; each metric sums the towers' states (metrics.py; accuracy:
[correct, compared], accuracy.py) and takes its value from the sums: the
single-device answers. A metric undefined on what was seen is left out.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from mgloop.runs.loop import tensor_branches_refused
from mgloop.training import metrics as metrics_lib
from mgloop.step import per_tower


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


class TowerInference:
    """evaluate/predict of the template model's copies (replicas.py) on their towers, with
    the training's loss and metrics (metrics.py)."""

    def __init__(self, replicas, loss_fn, metrics):
        self.replicas, self.loss_fn, self.metrics = replicas, loss_fn, list(metrics)

    def _tower_outputs(self, x, active: int) -> list[tuple[tf.Tensor, tf.Tensor]]:
        """Inference outputs of x split over the first `active` devices' first towers (with
        --towers_per_device=K one per device: inference has no per-tower statistics or
        random draws to keep apart): [(rows, outputs)]."""
        model, devices = self.replicas.model, self._devices()
        sizes = uneven_shard_sizes(tf.shape(tf.nest.flatten(x)[0])[0], active)
        shards = _split(x, sizes, active)
        kwargs = per_tower.call_kwargs(model, training=False)
        results = []
        for t, x_t in enumerate(shards):
            copy = self.replicas.copy_for_tower(t * self.replicas.towers_per_device)
            with tf.device(devices[t]):
                outputs, _ = model.stateless_call(
                    [tf.identity(v) for v in copy.trainable],
                    [tf.identity(v) for v in copy.non_trainable],
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
        """Mean loss and the metrics over every example of `batches`, computed on the towers.

        loss = (1/N) * sum over examples of the per-example loss (a tower's mean
        loss times its example count); each metric from its states summed over every
        tower and batch (e.g. accuracy = correct / compared, accuracy.py), a key only
        where it is defined.
        """
        loss_sum, count = 0.0, 0
        state_sum = np.zeros([metrics_lib.total_size(self.metrics)], np.float64)
        for x, y in batches:
            n = _batch_size(y)
            with tensor_branches_refused():
                batch_loss, batch_state = self._eval_batch(x, y, self._active_towers(n))
            loss_sum += float(batch_loss)
            state_sum += batch_state.numpy()
            count += n
        if not count:
            raise ValueError("evaluate() was given no examples; give at least one")
        return {"loss": loss_sum / count,
                **metrics_lib.results(self.metrics, metrics_lib.split(self.metrics, state_sum))}

    def predict(self, inputs, batch_size: int | None = None) -> np.ndarray:
        """Model outputs (inference mode) for every example, in input order, on the towers.

        `inputs`: a tf.data.Dataset of batches (x, or tuples whose first item is
        x), or an array of examples with `batch_size`.
        """
        if not isinstance(inputs, tf.data.Dataset):
            if batch_size is None:
                raise ValueError("predict() on an array needs batch_size")
            inputs = tf.data.Dataset.from_tensor_slices(inputs).batch(batch_size)
        outputs = []
        for batch in inputs:
            x = batch[0] if isinstance(batch, (tuple, list)) else batch
            active = self._active_towers(_batch_size(x))
            with tensor_branches_refused():
                predicted = self._predict_batch(x, active)
            outputs.append(tf.nest.map_structure(lambda o: o.numpy(), predicted))
        return tf.nest.map_structure(lambda *o: np.concatenate(o, axis=0), *outputs)
