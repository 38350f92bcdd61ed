"""`random_binary`: the inputs of the Keras multi-GPU blog post's big MLP, with learnable labels.

As in the post (`np.random.rand(n, 8000)`), every input is 8000 features drawn
uniformly from [0, 1). The post's labels were random coin flips, which no
model can learn; here the label is a fixed function of the input,

    y = 1 if w . (x - 1/2) > 0 else 0,    w ~ N(0, I) drawn once from the seed,

a linearly separable task with balanced classes, so a falling loss and a
rising accuracy show that training works. Two classes: `big_mlp` gives one
logit and the default loss is the binary cross-entropy (mgloop.training.losses).
"""

from __future__ import annotations

import numpy as np

from mgloop.data.base import InMemoryDataset

FEATURES = 8000


def make(seed: int, num_train: int = 2048, num_eval: int = 512,
         features: int = FEATURES) -> InMemoryDataset:
    rng = np.random.default_rng(seed)
    direction = rng.standard_normal(features).astype(np.float32)

    def split(n):
        x = rng.random((n, features), dtype=np.float32)
        y = ((x - 0.5) @ direction > 0).astype(np.int32)
        return x, y

    train_x, train_y = split(num_train)
    eval_x, eval_y = split(num_eval)
    return InMemoryDataset("random_binary", train_x, train_y, eval_x, eval_y, num_classes=2)
