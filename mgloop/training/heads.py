"""What a model's output is: logits, or probabilities of a softmax or sigmoid.

The default loss (losses.py) must know it: a cross-entropy on logits applied to
a softmax output computes -log softmax(softmax(z))[y], which stays near ln K
and trains badly, silently. mgloop reads the activation from the computation
itself, the same way for every kind of Keras model (Sequential, Functional,
subclassed, keras.applications such as MobileNetV2 with
`classifier_activation="softmax"`): it traces the template's forward pass
once, in inference mode, into a graph that never runs, and looks at the op
that produces the output, looking through ops that only move or re-type
values (Identity, Cast, Reshape, Squeeze, ExpandDims, StopGradient):

    Softmax -> "softmax"   (Dense/Conv activation="softmax", Activation, Softmax
                            layers, keras.ops.softmax, tf.nn.softmax: all end in it)
    Sigmoid -> "sigmoid"   (the same for sigmoid)
    else    -> "logits"    (linear, log_softmax, relu, ...: any real outputs)

What it cannot see: a softmax or sigmoid written out by hand (exp(z) / sum
exp(z)), or over an axis other than the last (traced as Transpose ops). Those
outputs count as logits; give such a model its loss explicitly. A model that
cannot be traced on a batch of the dataset's input shape (several inputs, an
input it does not accept) is "unknown": the default loss and the accuracy then
read `activation_of` their input each time a step is traced (what Keras's own
cross-entropy does), which sees the same ops unless they are hidden behind the
host's concatenation of `--aggregation=colocate`.
"""

from __future__ import annotations

import keras
import tensorflow as tf

LOGITS, SOFTMAX, SIGMOID = "logits", "softmax", "sigmoid"
_PASS_THROUGH = frozenset({"Identity", "IdentityN", "Cast", "Reshape", "Squeeze", "ExpandDims",
                           "StopGradient", "Snapshot"})


def activation_of(outputs) -> str | None:
    """The activation that produced the graph tensor `outputs` (LOGITS, SOFTMAX or
    SIGMOID); None for a value that has no producing op (eager tensors, numpy)."""
    if isinstance(outputs, tf.__internal__.EagerTensor) or not hasattr(outputs, "op"):
        return None
    tensor = outputs
    while tensor.op.type in _PASS_THROUGH and tensor.op.inputs:
        tensor = tensor.op.inputs[0]
    return {"Softmax": SOFTMAX, "Sigmoid": SIGMOID}.get(tensor.op.type, LOGITS)


def logits_behind_concat(outputs, activation: str):
    """For outputs concatenated on the batch axis from per-device parts that each come
    straight (through Identity copies) from a `activation` op: the concatenation of those
    ops' inputs, the logits; else None. (`--aggregation=colocate` joins the towers'
    outputs so; Keras's cross-entropy looks through the op only when it is the last.)"""
    if isinstance(outputs, tf.__internal__.EagerTensor) or not hasattr(outputs, "op"):
        return None
    if outputs.op.type != "ConcatV2":
        return None
    axis = tf.get_static_value(outputs.op.inputs[-1])
    if axis is None or int(axis) != 0:
        return None
    parts = []
    for part in outputs.op.inputs[:-1]:
        while part.op.type == "Identity":
            part = part.op.inputs[0]
        if part.op.type != {SOFTMAX: "Softmax", SIGMOID: "Sigmoid"}[activation]:
            return None
        parts.append(part.op.inputs[0])
    with tf.device(outputs.device):
        return tf.concat(parts, axis=0)


def _input_spec(model: keras.Model, input_shape) -> tf.TensorSpec | None:
    """The spec of a batch of the model's one input: from a Functional/Sequential model's
    own input, else the dataset's example shape as float32."""
    inputs = getattr(model, "inputs", None)
    try:
        if inputs:
            if len(inputs) != 1:
                return None
            return tf.TensorSpec(inputs[0].shape, inputs[0].dtype)
    except (AttributeError, ValueError):  # a subclassed model has no symbolic inputs
        pass
    if input_shape is None:
        return None
    return tf.TensorSpec([None, *input_shape], tf.float32)


def output_activation(model: keras.Model, input_shape=None) -> str | None:
    """LOGITS, SOFTMAX or SIGMOID for a built model with one output tensor, read from a
    trace of its inference forward pass (nothing runs); None where it cannot be traced.

    `input_shape` is one example's shape, used where the model has no symbolic input
    (subclassed models)."""
    spec = _input_spec(model, input_shape)
    if spec is None:
        return None
    found = []

    def forward(x):
        outputs = model(x, training=False)
        found.append(activation_of(outputs) if tf.is_tensor(outputs) else None)
        return outputs

    try:
        tf.function(forward, autograph=False).get_concrete_function(spec)
    except Exception:  # noqa: BLE001 -- any failure: undetectable, checked at the step's trace
        return None
    return found[0] if found else None
