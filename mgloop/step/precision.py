"""`--mixed_precision`: compute in float16 or bfloat16, keep float32 variables, scale the loss.

    none            mgloop sets no dtype policy (float32, or whatever the model function sets)
    mixed_bfloat16  the template model is built under Keras's `mixed_bfloat16` policy:
                    variables float32, layers compute in bfloat16. bfloat16 has float32's
                    exponent range, so gradients neither underflow nor overflow more than
                    in float32: no loss scaling.
    mixed_float16   Keras's `mixed_float16` policy, with dynamic loss scaling (below).

The policy is set only while the template model is built, then the previous global
policy is restored, so other models of the process are unaffected; the saved model
records its layers' policies and loads with plain Keras. Towers cast the logits to
float32 before the loss, so the loss and its mean are float32 whatever the policy.

Dynamic loss scaling (Keras `LossScaleOptimizer` semantics: initial scale 2**15,
doubled after 2000 consecutive finite steps, halved on a non-finite step). Every
variable copy holds a scale S (a variable of its optimizer, so checkpoints and the
replica sync carry it); all copies see the same decisions, so S is identical on
every copy. Tower t reads S from the copy it computes with and, on its device,

    g[t] = d(S * loss_t)/dv / S        (float16 backward, float32 gradient; unscaled
                                        before the exchange, so the exchange and a
                                        compressed transport carry normal-size values)
    finite_t = every element of every g[t][v] is finite

The flags are agreed explicitly, over every tower of every worker: each worker counts
its units whose gradient is not finite, on its host,

    bad_w = sum_{t in w} (1 - finite_t)                       (float32, exact: <= 2**24)

and the count travels with the step's metrics (mean loss, metric states) in the
collective the exchange already makes between workers (cross_worker.py,
`reduce_with_metrics`), so every worker receives the same bad = sum_w bad_w: 4 bytes
more, counted as state, and no message more. In one process the metrics come back as
given (bad = bad_0). all_finite = (bad == 0) is sent from the host to every copy, also
for `independent`, where no gradient is shared. Then on every copy of every worker at
once:

    all_finite      apply the update; count the finite step; after 2000 in a row S <- 2 S
    not all_finite  change nothing: weights, optimizer slots and iterations, and the
                    non-trainable state (moving statistics) stay as they were; S <- S / 2
                    and the count restarts

Why a count and not the exchanged gradient's own finiteness (which would cost nothing
when every worker receives the same reduced gradient): the reduced gradient is not
finite exactly when some tower's is only for an exact sum. A robust rule (median,
trimmed mean, clipping) can leave out the overflowing node, so its error feedback and
state would take the inf while the step is applied; a compressor may turn inf into a
finite code (a sign) or into NaN everywhere; local methods (DiLoCo, local SGD) exchange
nothing on most steps, and each worker would decide from its own towers alone. The
count gives every worker the decision one process makes over the same towers (AND over
all of them), whatever the method, which is what makes N workers equal N simulated
nodes (tests/test_nodes_workers.py).

(Keras updates moving statistics in the forward pass even on a skipped step; mgloop
keeps them, so an overflow in the forward pass cannot write inf into the model.)
The global step still advances: a skipped step consumed its batches.
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

INITIAL_SCALE = 2.0 ** 15
GROWTH_INTERVAL = 2000  # consecutive finite steps before the scale doubles
GROWTH_FACTOR = 2.0


def uses_loss_scaling(policy: str) -> bool:
    return policy == "mixed_float16"


@contextlib.contextmanager
def policy_scope(policy: str):
    """Keras's global dtype policy is `policy` inside; the previous one is restored after."""
    if policy == "none":
        yield
        return
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def to_float32(logits: tf.Tensor) -> tf.Tensor:
    """Logits of a float16/bfloat16 model as float32, for the loss."""
    return tf.cast(logits, tf.float32) if logits.dtype in (tf.float16, tf.bfloat16) else logits


def all_finite(values: list[tf.Tensor]) -> tf.Tensor:
    """True (bool scalar) when every element of every value is finite."""
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values]))


class DynamicLossScale:
    """The loss scale of one variable copy: two variables of that copy's optimizer."""

    def __init__(self, optimizer: keras.optimizers.Optimizer, device: str):
        with tf.device(device):
            self.scale = optimizer.add_variable(
                (), initializer=keras.initializers.Constant(INITIAL_SCALE), dtype="float32",
                name="loss_scale")
            self.finite_steps = optimizer.add_variable(
                (), initializer="zeros", dtype="int64", name="loss_scale_finite_steps")
        self.device = device

    def read(self) -> tf.Tensor:
        with tf.device(self.device):
            return self.scale.value.read_value()

    def apply_if_finite(self, finite: tf.Tensor, update) -> None:
        """Runs `update()` and counts the step if `finite`, else halves the scale."""
        scale, steps = self.scale.value, self.finite_steps.value

        def apply():
            update()
            grow = tf.equal(steps.read_value(), GROWTH_INTERVAL - 1)
            scale.assign(tf.where(grow, scale.read_value() * GROWTH_FACTOR, scale.read_value()))
            steps.assign(tf.where(grow, tf.constant(0, tf.int64), steps.read_value() + 1))

        def skip():
            scale.assign(scale.read_value() / GROWTH_FACTOR)
            steps.assign(tf.constant(0, tf.int64))

        with tf.device(self.device):
            tf.cond(finite, apply, skip)


def non_finite_units(unit_grads: list[list[tf.Tensor]], units: list[str],
                     aggregation) -> tf.Tensor:
    """bad_w: how many of this worker's units hold a non-finite gradient element, a float32
    scalar on the host (each unit's flag formed on its device, sent to the host)."""
    host = aggregation.devices.host
    flags = []
    for grads, device in zip(unit_grads, units):
        with tf.device(device):
            flag = all_finite(grads)
        flags.append(aggregation.send(flag, device, host))
    with tf.device(host):
        return tf.reduce_sum(1.0 - tf.cast(tf.stack(flags), tf.float32))


def agreed_finite(bad: tf.Tensor, aggregation, copy_devices: list[str]) -> list[tf.Tensor]:
    """all_finite = (bad == 0), bad the count summed over every worker, formed on the host
    and sent to every copy's device: one unit's overflow skips the update on every copy."""
    host = aggregation.devices.host
    with tf.device(host):
        agreed = tf.equal(bad, 0.0)
    return [aggregation.send(agreed, host, device) for device in copy_devices]
