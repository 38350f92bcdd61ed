"""`minigooglenet`: MiniGoogLeNet, the CIFAR-10 network of the 2017 PyImageSearch tutorial
"How-To: Multi-GPU training with Keras, Python, and deep learning".

Three modules (channels last; every convolution is conv -> batch norm -> relu):

    conv(K, k, stride)      Conv2D(K, k x k, stride, "same") -> BatchNorm -> ReLU
    inception(K1, K3)       concat(conv(K1, 1x1), conv(K3, 3x3))        (K1 + K3 channels)
    downsample(K)           concat(conv(K, 3x3, stride 2, "valid"), MaxPool(3x3, stride 2))

and the network, for 32x32x3 inputs:

    conv(96, 3x3)                                                    32x32x96
    inception(32, 32), inception(32, 48), downsample(80)             15x15x240
    inception(112, 48), inception(96, 64), inception(80, 80),
    inception(48, 96), downsample(96)                                7x7x240
    inception(176, 160), inception(176, 160)                         7x7x336
    AveragePooling(7x7), Dropout(0.5), Flatten, Dense(classes)       logits

1,656,250 parameters for 10 classes (Keras `count_params`: 1,652,826
trainable, 3,424 batch-norm moving statistics; Dropout's seed state aside).
The tutorial ends with a softmax; here the model outputs logits and the loss
applies the softmax (mgloop.training.losses), as for every model. Batch norm in
mgloop's tower loop normalises each tower's shard by its own statistics; the
moving statistics are averaged over towers after each step.
"""

import keras

from mgloop.models.builders import register

layers = keras.layers


def conv_module(x, filters, kernel, stride=1, padding="same"):
    x = layers.Conv2D(filters, kernel, strides=stride, padding=padding)(x)
    x = layers.BatchNormalization()(x)
    return layers.Activation("relu")(x)


def inception_module(x, filters_1x1, filters_3x3):
    return layers.Concatenate()([conv_module(x, filters_1x1, 1), conv_module(x, filters_3x3, 3)])


def downsample_module(x, filters):
    conv = conv_module(x, filters, 3, stride=2, padding="valid")
    pool = layers.MaxPooling2D(3, strides=2)(x)
    return layers.Concatenate()([conv, pool])


@register("minigooglenet")
def minigooglenet(input_shape, num_classes):
    inputs = keras.Input(shape=tuple(input_shape))
    x = conv_module(inputs, 96, 3)
    x = inception_module(x, 32, 32)
    x = inception_module(x, 32, 48)
    x = downsample_module(x, 80)
    for filters_1x1, filters_3x3 in ((112, 48), (96, 64), (80, 80), (48, 96)):
        x = inception_module(x, filters_1x1, filters_3x3)
    x = downsample_module(x, 96)
    x = inception_module(x, 176, 160)
    x = inception_module(x, 176, 160)
    x = layers.AveragePooling2D(7)(x)
    x = layers.Dropout(0.5)(x)
    x = layers.Flatten()(x)
    outputs = layers.Dense(num_classes)(x)
    return keras.Model(inputs, outputs, name="minigooglenet")
