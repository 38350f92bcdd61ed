"""Learning-rate schedules follow their formulas.

Each schedule is a handful of float32 operations (Keras's PolynomialDecay and
CosineDecay, optim.LinearWarmup); the float64 formula is the exact value, and the
bounds below count the roundings (u = 2^-24, tolerance.gamma), with pow within
tolerance.ELEMENTARY_ULPS u relative and cos within ELEMENTARY_ULPS u absolute on [0, pi].
"""

import math

import pytest

from mgloop.spec import optim
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
    return optim.make_schedule(helpers.small_config("/tmp/unused", **overrides))


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


def test_constant():
    lr = schedule(learning_rate=0.3, train_steps=10)
    assert {round(float(lr(s)), 7) for s in range(0, 12)} == {0.3}
