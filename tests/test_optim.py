"""Learning-rate schedules follow their formulas; Keras's SGD runs as TensorFlow's fused
kernels (optim.fused_sgd) within the roundings of its own update.

Each schedule is a handful of float32 operations (Keras's PolynomialDecay and
CosineDecay, optim.LinearWarmup); the float64 formula is the exact value, and the
bounds below count the roundings (u = 2^-24, tolerance.gamma), with pow within
tolerance.ELEMENTARY_ULPS u relative and cos within ELEMENTARY_ULPS u absolute on [0, pi].
"""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from mgloop.training import optim
from mgloop.training.variables import VariableCopy
from mgloop.errors import ConfigError
from tests import helpers
from tests.tolerance import ELEMENTARY_ULPS, U, gamma


def poly_bound(lr: float, base: float, power: float) -> float:
    """lr * pow(1 - s / D, power) in float32: s / D and 1 - p round once each, so the base
    b is within gamma(2) (p + b = 1); pow moves by power (b + gamma(2))^(power-1) gamma(2)
    = d, then rounds; lr's rounding to float32 and the product: within
    lr (d + gamma(ELEMENTARY_ULPS + 2) (b^power + d))."""
    moved = power * (base + gamma(2)) ** (power - 1) * gamma(2)
    return lr * (moved + gamma(ELEMENTARY_ULPS + 2) * (base ** power + moved))


def cosine_bound(lr: float, fraction: float) -> float:
    """lr * 0.5 (1 + cos(pi f)) in float32: f = s / D, pi in float32 and their product
    put the angle within gamma(3) pi f; cos (1-Lipschitz) adds ELEMENTARY_ULPS u, 1 + c
    rounds (<= 2 u), 0.5 x is exact; lr's rounding and the product: gamma(2)."""
    decayed = 0.5 * (1 + math.cos(math.pi * fraction))
    inner = 0.5 * (gamma(3) * math.pi * fraction + (ELEMENTARY_ULPS + 2) * U)
    return lr * (inner + gamma(2) * decayed) * (1 + gamma(2))


def schedule(**overrides):
    config = helpers.small_config("/tmp/unused", **overrides)
    return optim.make_schedule(config.optim, config.train_steps)


@pytest.mark.parametrize("step", [0, 10, 55, 99, 100])
def test_poly_is_caffe_polynomial_decay(step):
    lr = schedule(lr_schedule="poly", learning_rate=0.5, lr_power=2.0, train_steps=100)
    base = 1 - step / 100
    assert abs(float(lr(step)) - 0.5 * base ** 2) <= poly_bound(0.5, base, 2.0)


@pytest.mark.parametrize("step", [0, 25, 50, 100])
def test_cosine(step):
    lr = schedule(lr_schedule="cosine", learning_rate=0.2, train_steps=100)
    expected = 0.1 * (1 + math.cos(math.pi * step / 100))
    assert abs(float(lr(step)) - expected) <= cosine_bound(0.2, step / 100)


def test_warmup_rises_linearly_then_follows_the_schedule():
    lr = schedule(lr_schedule="poly", learning_rate=0.4, warmup_steps=4, train_steps=24)
    power = lr.after.power
    for s, expected in enumerate([0.1, 0.2, 0.3, 0.4]):  # peak (s + 1) / 4: 3 roundings
        assert abs(float(lr(s)) - expected) <= gamma(3) * expected
    assert abs(float(lr(4)) - 0.4) <= poly_bound(0.4, 1.0, power)
    assert abs(float(lr(14)) - 0.4 * (1 - 10 / 20) ** power) <= poly_bound(0.4, 0.5, power)


def test_constant_is_the_rate_at_every_step():
    lr = schedule(learning_rate=0.3, train_steps=10)
    assert isinstance(lr, optim.Constant)
    assert {float(lr(s)) for s in (0, 9, 10, 10 ** 9)} == {float(np.float32(0.3))}


def op_types(function, *args) -> set[str]:
    """The op types of a tf.function's graph for `args`, its inner functions' included."""
    graph = function.get_concrete_function(*args).graph.as_graph_def()
    return {n.op for f in graph.library.function for n in f.node_def} | {
        n.op for n in graph.node}


def sgd_updates(fused: bool, momentum: float, nesterov: bool, steps: int = 3):
    """Three SGD steps on hand-made values (magnitudes spread over 1e-3..1e3), traced in one
    tf.function: (the variable and momentum after each step, the update ops' types)."""
    rng = np.random.default_rng(5)
    start = (rng.standard_normal((7, 5)) * 10.0 ** rng.integers(-3, 4, (7, 5)))
    grads = [rng.standard_normal((7, 5)).astype(np.float32) for _ in range(steps)]
    variable = tf.Variable(start.astype(np.float32))
    optimizer = keras.optimizers.SGD(0.05, momentum=momentum, nesterov=nesterov)
    optimizer.build([variable])
    if fused:
        optimizer.update_step = optim.fused_sgd(optimizer)

    @tf.function
    def step(g):
        optimizer.apply([g], [variable])
    values = []
    for g in grads:
        step(tf.constant(g))
        slot = optimizer.momentums[0].numpy() if momentum else np.zeros_like(start)
        values.append((variable.numpy().astype(np.float64), slot.astype(np.float64), g))
    return values, op_types(step, tf.constant(grads[0]))


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_fused_sgd_is_keras_sgd(momentum, nesterov):
    """Keras's update and the fused kernel compute m' = m mu - g lr and v' = v + m' (nesterov:
    v + (m' mu - g lr); mu = 0: v - g lr) in the same float32 operations; a kernel
    contracting a product into a sum (FMA) skips one rounding per operation, so each step
    may differ by gamma(2) of the magnitudes it adds, carried on through mu and the sum."""
    keras_values, keras_ops = sgd_updates(False, momentum, nesterov)
    fused_values, fused_ops = sgd_updates(True, momentum, nesterov)
    kernel = "ResourceApplyKerasMomentum" if momentum else "ResourceApplyGradientDescent"
    assert kernel in fused_ops and kernel not in keras_ops
    lr, dm, dv = 0.05, 0.0, 0.0
    for (v, m, g), (fv, fm, _) in zip(keras_values, fused_values):
        step = np.abs(g) * lr
        dm = momentum * dm + gamma(2) * (momentum * np.abs(m) + step)
        dv = dv + dm * (1 + momentum) + gamma(3) * (np.abs(v) + np.abs(m) + step)
        assert np.all(np.abs(fm - m) <= dm) and np.all(np.abs(fv - v) <= dv)


def test_fused_sgd_leaves_other_optimizers_to_keras():
    class OwnSGD(keras.optimizers.SGD):
        def update_step(self, gradient, variable, learning_rate):
            return super().update_step(gradient, variable, learning_rate)
    assert optim.fused_sgd(keras.optimizers.Adam(0.1)) is None
    assert optim.fused_sgd(OwnSGD(0.1)) is None
    assert optim.fused_sgd(keras.optimizers.SGD(0.1)) is not None


@pytest.mark.parametrize("optimizer,kernel", [("momentum", "ResourceApplyKerasMomentum"),
                                              ("sgd", "ResourceApplyGradientDescent"),
                                              ("adam", "AssignAddVariableOp")])
def test_every_copy_applies_keras_sgd_by_the_fused_kernel(optimizer, kernel, tmp_path):
    """What the runs build (optim.build_optimizers) updates by the fused kernel, on the
    copy's device; Adam keeps Keras's own element-wise update."""
    config = helpers.small_config(str(tmp_path), optimizer=optimizer)
    weights = tf.Variable(np.ones((3, 2), np.float32))
    copy = VariableCopy("/device:CPU:0", [weights], [])
    optim.build_optimizers([copy],
                           lambda: optim.make_optimizer(config.optim, config.train_steps))

    @tf.function
    def apply(g):
        optim.apply_updates([copy], [[g]])
    ops = op_types(apply, tf.ones((3, 2)))
    assert kernel in ops
    assert ("ResourceApplyKerasMomentum" in ops or "ResourceApplyGradientDescent" in ops) == (
        optimizer != "adam")


@pytest.mark.parametrize("value", [0.0, -1e-7, float("nan"), float("inf")])
def test_an_adam_epsilon_that_is_not_a_positive_finite_number_is_refused_in_one_line(
        value, tmp_path):
    with pytest.raises(ConfigError) as error:
        helpers.small_config(str(tmp_path), optimizer="adam", adam_epsilon=value).validated()
    assert "\n" not in str(error.value) and "adam_epsilon" in str(error.value)
