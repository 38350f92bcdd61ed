"""`resnet20`: the CIFAR-10 ResNet-20 of He et al. (2016), section 4.2.

    conv 3x3, 16 -> BN -> ReLU                                       32x32x16
    stage 1: 3 basic blocks, 16 filters                              32x32x16
    stage 2: 3 basic blocks, 32 filters (first block: stride 2)      16x16x32
    stage 3: 3 basic blocks, 64 filters (first block: stride 2)      8x8x64
    global average pooling -> Dense(classes)                         logits

A basic block is conv 3x3 -> BN -> ReLU -> conv 3x3 -> BN, added to its
shortcut, then ReLU: 6n + 2 = 20 layers with weights for n = 3. Where the
shape changes (the first block of stages 2 and 3) the shortcut is a 1x1
convolution with stride 2 followed by BN (the paper's option B; its CIFAR
runs used option A, zero-padding, which needs a custom layer, and mgloop's
models use only built-in layers so that exports load without mgloop).
Convolutions have no bias (BN follows each). 274,042 parameters for 10
classes (272,474 trainable, 1,568 batch-norm moving statistics).
"""

import keras

from mgloop.models.builders import register

layers = keras.layers
STAGES = (16, 32, 64)
BLOCKS_PER_STAGE = 3


def conv_bn(x, filters, kernel, stride=1):
    x = layers.Conv2D(filters, kernel, strides=stride, padding="same", use_bias=False)(x)
    return layers.BatchNormalization()(x)


def basic_block(x, filters, stride):
    shortcut = x
    if stride != 1 or x.shape[-1] != filters:
        shortcut = conv_bn(x, filters, 1, stride)
    y = layers.Activation("relu")(conv_bn(x, filters, 3, stride))
    y = conv_bn(y, filters, 3)
    return layers.Activation("relu")(layers.Add()([y, shortcut]))


@register("resnet20")
def resnet20(input_shape, num_classes):
    inputs = keras.Input(shape=tuple(input_shape))
    x = layers.Activation("relu")(conv_bn(inputs, STAGES[0], 3))
    for stage, filters in enumerate(STAGES):
        for block in range(BLOCKS_PER_STAGE):
            x = basic_block(x, filters, 2 if stage > 0 and block == 0 else 1)
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(num_classes)(x)
    return keras.Model(inputs, outputs, name="resnet20")
