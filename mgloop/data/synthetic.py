"""`synthetic`: a learnable classification task generated from a seed.

Each class c has a fixed random prototype p_c ~ N(0, 1) of the input shape; an
example of class c is x = SIGNAL * p_c + noise, noise ~ N(0, 1). Labels are a
function of the input (nearest prototype, up to noise), not random, so a model
can learn them: loss falls and accuracy rises well above 1/num_classes.
`synthetic` has 8x8x3 inputs; `synthetic_cifar` 32x32x3 (CIFAR-10's shape, for
the image models without the files), 4096 training examples.
"""

from __future__ import annotations

import numpy as np

from mgloop.data.base import InMemoryDataset

SIGNAL = 0.25


CIFAR_SHAPE = (32, 32, 3)  # `synthetic_cifar`: the same task in CIFAR-10's shape


def make(seed: int, num_train: int = 8192, num_eval: int = 1024,
         input_shape=(8, 8, 3), num_classes: int = 10,
         name: str = "synthetic") -> InMemoryDataset:
    rng = np.random.default_rng(seed)
    prototypes = rng.standard_normal((num_classes, *input_shape)).astype(np.float32)

    def split(n):
        y = rng.integers(num_classes, size=n).astype(np.int32)
        x = SIGNAL * prototypes[y] + rng.standard_normal((n, *input_shape)).astype(np.float32)
        return x.astype(np.float32), y

    train_x, train_y = split(num_train)
    eval_x, eval_y = split(num_eval)
    return InMemoryDataset(name, train_x, train_y, eval_x, eval_y, num_classes)
