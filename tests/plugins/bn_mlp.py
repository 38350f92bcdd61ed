"""`--model=bn_mlp`: a small MLP with batch norm, registered by a plugin (`--plugin=
tests.plugins.bn_mlp`), so that a CLI run has moving statistics (non-trainable state)."""

import keras

from mgloop import models


@models.register("bn_mlp")
def bn_mlp(input_shape, num_classes):
    return keras.Sequential([
        keras.Input(shape=tuple(input_shape)), keras.layers.Flatten(),
        keras.layers.Dense(32), keras.layers.BatchNormalization(), keras.layers.ReLU(),
        keras.layers.Dense(num_classes)], name="bn_mlp")
