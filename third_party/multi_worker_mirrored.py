"""Baseline: `tf.distribute.MultiWorkerMirroredStrategy` with a custom training loop.

Re-creates the TensorFlow tutorial "Custom training loop with Keras and
MultiWorkerMirroredStrategy", TensorFlow's own answer to data-parallel training
over several processes: every worker runs this same program with its own
TF_CONFIG; the strategy (created first, before any other TensorFlow op) starts
the worker's gRPC server, the model and optimizer are created in
`strategy.scope()` (every variable is mirrored on the worker's local devices,
initial values broadcast from worker 0), each worker reads its own part of
every global batch through `strategy.distribute_datasets_from_function`, and
each replica r of the R = W * L replicas (W workers, L local devices) runs

    loss_r = sum over its examples i of loss_i / global batch   (tf.nn.compute_average_loss)
    optimizer.apply_gradients(grads of loss_r)

(loss_i: the mean of example i's loss values, over its L tokens for a sequence:
mirrored_strategy.per_example)

inside `strategy.run`; the Keras optimizer sums the R replicas' gradients with
the strategy's CollectiveAllReduce (local devices and workers in one collective
group, over gRPC between workers), so every copy applies the gradient of the
mean loss over the global batch; the reported loss is the sum over replicas of
loss_r (`strategy.reduce`, itself a collective across workers).

Local devices. In TensorFlow 2.21 (collective_all_reduce_strategy.py,
`CollectiveAllReduceExtended._initialize_local_devices`), a worker with no GPU
uses exactly one local device, `/job:worker/task:i/device:CPU:0`, whatever
logical CPU devices exist; the public constructor takes only a cluster
resolver and communication options, and `cluster_resolver.num_accelerators()`
can only ask for GPUs or TPUs. So on CPU this baseline is W workers x 1 device
(L = 1); with GPUs it uses every GPU the worker sees (the benchmark gives each
worker its own CUDA_VISIBLE_DEVICES). No private constructor is used.

For a fair comparison with mgloop, `train_loop` runs `num_steps` steps inside
one `tf.function` call with a `tf.range` loop (the tutorial calls one
`tf.function` per step), and worker w reads the contiguous slice
[w*B/W, (w+1)*B/W) of every global batch B, as mgloop's workers do
(mgloop.data.batch_split.worker_part); its L replicas then take consecutive B/R
chunks of that slice.
"""

from __future__ import annotations

from typing import Callable

import keras
import tensorflow as tf

from third_party import mirrored_strategy


def make_strategy(timeout_seconds: float | None = None
                  ) -> tf.distribute.MultiWorkerMirroredStrategy:
    """The strategy of this worker's TF_CONFIG. Create it before any other TensorFlow op.

    `timeout_seconds`: how long a collective waits for its peers before failing.
    """
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout_seconds)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)


class CustomLoop:
    """Model, optimizer and compiled multi-step loop under one MultiWorkerMirroredStrategy."""

    def __init__(self, strategy: tf.distribute.MultiWorkerMirroredStrategy,
                 model_fn: Callable[[], keras.Model], loss_fn,
                 optimizer_fn: Callable[[], keras.optimizers.Optimizer], global_batch: int):
        self.strategy = strategy
        self.loss_fn = loss_fn
        self.global_batch = global_batch
        if global_batch % strategy.num_replicas_in_sync:
            raise ValueError(f"global batch {global_batch} does not split into "
                             f"{strategy.num_replicas_in_sync} replicas")
        with strategy.scope():
            self.model = model_fn()
            self.optimizer = optimizer_fn()
            self.optimizer.build(self.model.trainable_variables)

    @property
    def local_devices(self) -> tuple[str, ...]:
        return tuple(self.strategy.extended.worker_devices)

    def distribute(self, batches: tf.data.Dataset):
        """An iterator of this worker's replicas' parts of the global batches of `batches`."""
        replicas = self.strategy.num_replicas_in_sync

        def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
            workers, index = context.num_input_pipelines, context.input_pipeline_id
            local = replicas // workers  # replicas of this input pipeline (this worker)
            per_replica = self.global_batch // replicas

            def mine(t):  # this worker's slice, as `local` consecutive per-replica chunks
                parts = tf.reshape(t, [workers, local, per_replica, *t.shape[1:]])
                return parts[index]

            return batches.map(lambda x, y: (mine(x), mine(y))).unbatch()

        return iter(self.strategy.distribute_datasets_from_function(dataset_fn))

    def _replica_step(self, x, y):
        with tf.GradientTape() as tape:
            predictions = self.model(x, training=True)
            per_example = mirrored_strategy.per_example(self.loss_fn(y, predictions))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=self.global_batch)
            if self.model.losses:
                loss += tf.nn.scale_regularization_loss(tf.add_n(self.model.losses))
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return loss

    @tf.function
    def train_loop(self, iterator, num_steps):
        """`num_steps` steps in one call; returns the sum of the steps' mean losses."""
        loss_sum = tf.constant(0.0)
        for _ in tf.range(num_steps):
            x, y = next(iterator)
            per_replica = self.strategy.run(self._replica_step, args=(x, y))
            loss_sum += self.strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
        return loss_sum
