"""Evaluation and prediction on the towers (the `Trainer`'s inference methods).

Evaluation and prediction split each batch of n examples over the towers in
contiguous uneven shards, tower 0 first: with a = min(n, T) towers in use,
tower t < a gets floor(n/a) examples plus one if t < n mod a, so a final batch
smaller than the tower count works. Eval sums per-example losses (a tower's
mean loss times its example count) over all towers and batches and divides
by the example count; accuracy sums the towers' counts [correct, compared]
(accuracy.py) and divides: the single-device answers. Accuracy is left out
where the loss defines none.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from mgloop import accuracy
from mgloop import towers


def uneven_shard_sizes(n: tf.Tensor, active: int) -> list[tf.Tensor]:
    """Contiguous shard sizes of n examples over `active` towers, differing by at most one."""
    base, extra = n // active, n % active
    return [base + tf.cast(t < extra, n.dtype) for t in range(active)]


class TowerInference:
    """evaluate/predict for a class with `model`, `loss_fn`, `tower_devices`, `num_towers`,
    `aggregation` and `copy_for_tower(t)` (the Trainer)."""

    def _tower_outputs(self, x: tf.Tensor, active: int) -> list[tuple[tf.Tensor, tf.Tensor]]:
        """Inference outputs of x split over the first `active` towers: [(rows, outputs)]."""
        sizes = uneven_shard_sizes(tf.shape(x)[0], active)
        shards = tf.split(x, tf.stack(sizes), num=active) if active > 1 else [x]
        kwargs = towers.call_kwargs(self.model, training=False)
        results = []
        for t, x_t in enumerate(shards):
            copy = self.copy_for_tower(t)
            with tf.device(self.tower_devices[t]):
                outputs, _ = self.model.stateless_call(
                    [tf.identity(v) for v in copy.trainable],
                    [tf.identity(v) for v in copy.non_trainable], tf.identity(x_t), **kwargs)
            results.append((sizes[t], outputs))
        return results

    @tf.function(reduce_retracing=True)
    def _eval_batch(self, x, y, active: int):
        """(sum of per-example losses, accuracy counts [correct, compared]) over one batch,
        on `active` towers."""
        results = self._tower_outputs(x, active)
        sizes = [size for size, _ in results]
        ys = tf.split(y, tf.stack(sizes), num=active) if active > 1 else [y]
        loss_sums, counts = [], []
        for t, ((size, logits), y_t) in enumerate(zip(results, ys)):
            with tf.device(self.tower_devices[t]):
                mean = tf.reduce_mean(self.loss_fn(y_t, logits))
                loss_sums.append(mean * tf.cast(size, mean.dtype))
                counts.append(accuracy.counts(self.loss_fn, y_t, logits))
        with tf.device(self.aggregation.devices.host):
            return tf.add_n(loss_sums), tf.add_n(counts)

    @tf.function(reduce_retracing=True)
    def _predict_batch(self, x, active: int):
        outputs = [out for _, out in self._tower_outputs(x, active)]
        with tf.device(self.aggregation.devices.host):
            return tf.concat(outputs, axis=0)

    def _active_towers(self, batch_size: int) -> int:
        return max(1, min(batch_size, self.num_towers))

    def evaluate(self, batches: tf.data.Dataset) -> dict[str, float]:
        """Mean loss and accuracy over every example of `batches`, computed on the towers.

        loss = (1/N) * sum over examples of the per-example loss (a tower's mean
        loss times its example count); accuracy = correct / compared (predictions:
        examples, tokens or labels, accuracy.py), a key only where the loss defines it.
        """
        loss_sum = correct = compared = count = 0.0
        for x, y in batches:
            batch_loss, batch_counts = self._eval_batch(
                x, y, self._active_towers(int(y.shape[0])))
            loss_sum += float(batch_loss)
            correct += float(batch_counts[0])
            compared += float(batch_counts[1])
            count += int(y.shape[0])
        if not count:
            raise ValueError("evaluate() was given no examples")
        metrics = {"loss": loss_sum / count}
        if compared:
            metrics["accuracy"] = accuracy.accuracy_of(correct, compared)
        return metrics

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
            active = self._active_towers(int(x.shape[0]))
            outputs.append(self._predict_batch(x, active).numpy())
        return np.concatenate(outputs, axis=0)
