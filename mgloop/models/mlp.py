"""`mlp`: a small multi-layer perceptron (overhead-bound: framework cost shows)."""

import keras

from mgloop.models.builders import register


@register("mlp")
def mlp(input_shape, num_classes, width=128, depth=2):
    layers = [keras.Input(shape=tuple(input_shape)), keras.layers.Flatten()]
    layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
    layers.append(keras.layers.Dense(num_classes))
    return keras.Sequential(layers, name="mlp")
