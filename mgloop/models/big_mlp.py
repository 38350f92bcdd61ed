"""`big_mlp`: the 41-million-parameter MLP of the 2016 Keras multi-GPU blog post.

kuza55's "Transparent Multi-GPU Training on TensorFlow with Keras" (the post
that introduced `make_parallel`) trains, on `np.random.rand(131072, 8000)`
inputs with random 0/1 labels,

    Dense(4000, tanh) -> Dense(2000, relu) -> Dense(500, relu) -> Dense(300, relu)
    -> Dense(1, sigmoid),  binary cross-entropy

which Keras reports as 41,157,101 parameters for 8000 inputs:
8000*4000+4000 + 4000*2000+2000 + 2000*500+500 + 500*300+300 + 300*1+1.
Each step moves and applies 165 MB of float32 gradients, so the exchange and
the update weigh more than the arithmetic of small batches: the
communication-bound model of the benchmark.

One difference: the last layer outputs the logit, not the sigmoid of it, as
every mgloop model outputs logits; the default loss (mgloop.training.losses) applies
the sigmoid inside the binary cross-entropy (`sigmoid_cross_entropy_with_logits`),
which is the numerically stable form of the same function. With a dataset of
two classes (`--dataset=random_binary`) the model has the post's single
output unit; with K > 2 classes it has K outputs (softmax cross-entropy).
"""

import keras

from mgloop.models.builders import register

WIDTHS = (4000, 2000, 500, 300)
ACTIVATIONS = ("tanh", "relu", "relu", "relu")


def output_units(num_classes: int) -> int:
    """One logit for two classes (the log-odds of class 1), else one per class."""
    return 1 if num_classes == 2 else num_classes


@register("big_mlp")
def big_mlp(input_shape, num_classes):
    layers = [keras.Input(shape=tuple(input_shape)), keras.layers.Flatten()]
    layers += [keras.layers.Dense(width, activation=activation)
               for width, activation in zip(WIDTHS, ACTIVATIONS)]
    layers.append(keras.layers.Dense(output_units(num_classes)))
    return keras.Sequential(layers, name="big_mlp")
