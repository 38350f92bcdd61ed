"""Learning-rate schedules follow their formulas."""

import math

import pytest

from mgloop import optim
from tests import helpers


def schedule(**overrides):
    return optim.make_schedule(helpers.small_config("/tmp/unused", **overrides))


@pytest.mark.parametrize("step", [0, 10, 55, 99, 100])
def test_poly_is_caffe_polynomial_decay(step):
    lr = schedule(lr_schedule="poly", learning_rate=0.5, lr_power=2.0, train_steps=100)
    assert float(lr(step)) == pytest.approx(0.5 * (1 - step / 100) ** 2, rel=1e-5, abs=1e-8)


@pytest.mark.parametrize("step", [0, 25, 50, 100])
def test_cosine(step):
    lr = schedule(lr_schedule="cosine", learning_rate=0.2, train_steps=100)
    assert float(lr(step)) == pytest.approx(0.1 * (1 + math.cos(math.pi * step / 100)), abs=1e-6)


def test_warmup_rises_linearly_then_follows_the_schedule():
    lr = schedule(lr_schedule="poly", learning_rate=0.4, warmup_steps=4, train_steps=24)
    assert [round(float(lr(s)), 6) for s in range(4)] == [0.1, 0.2, 0.3, 0.4]
    assert float(lr(4)) == pytest.approx(0.4)
    assert float(lr(14)) == pytest.approx(0.4 * (1 - 10 / 20), rel=1e-5)


def test_constant():
    lr = schedule(learning_rate=0.3, train_steps=10)
    assert {round(float(lr(s)), 7) for s in range(0, 12)} == {0.3}
