"""`cnn`: a small convolutional network for image-shaped inputs."""

import keras

from mgloop.models.builders import register


@register("cnn")
def cnn(input_shape, num_classes, filters=16):
    return keras.Sequential([
        keras.Input(shape=tuple(input_shape)),
        keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(filters, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(2 * filters, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(num_classes),
    ], name="cnn")
