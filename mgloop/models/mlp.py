"""`mlp`: a small multi-layer perceptron (overhead-bound: framework cost shows).

`--mlp_depth` hidden ReLU layers (default 2) of `--mlp_width` units (default 128), then the
logits: 2 * depth + 2 variables. A traced step's ops grow with the variables (each has its
gradient, exchange and update), its compute with the width.
"""

import keras

from mgloop.models.builders import register


@register("mlp", settings=("mlp_width", "mlp_depth"))
def mlp(input_shape, num_classes, mlp_width=128, mlp_depth=2):
    layers = [keras.Input(shape=tuple(input_shape)), keras.layers.Flatten()]
    layers += [keras.layers.Dense(mlp_width, activation="relu") for _ in range(mlp_depth)]
    layers.append(keras.layers.Dense(num_classes))
    return keras.Sequential(layers, name="mlp")
