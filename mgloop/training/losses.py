"""The default loss: the cross-entropy that matches the model's output.

`cross_entropy` (what `experiment.default_loss()` returns) is resolved against
the template model when the Trainer is built (`for_model`): heads.py reads the
output activation, and the Trainer uses

    logits   CrossEntropy("logits")    the activation applied inside the loss
    softmax  CrossEntropy("softmax")   Keras's cross-entropy on probabilities
    sigmoid  CrossEntropy("sigmoid")   (from_logits=False), as a Keras model compiled
                                       with that loss computes it

so an activation is never applied twice. A softmax over one unit (always 1) is
refused. Any other `loss_fn` is used as given. Where the model cannot be traced
(heads.py), `cross_entropy` reads the activation from the op that produced
its input when the step is traced (logits unless a Softmax/Sigmoid op).

Per element, with labels y and model outputs z (logits) or p (probabilities),
on the last axis of K units; labels either integers with the outputs' shape
minus that axis (a trailing 1 allowed), or, for K > 1 under softmax/logits,
one-hot (or soft) rows with the outputs' shape:

    logits, K > 1:   -log softmax(z)[y]        (tf.nn.sparse_softmax_cross_entropy_with_logits;
                                                one-hot: -sum_k y_k log softmax(z)_k)
    logits, K = 1:   max(z, 0) - z y + log(1 + exp(-|z|))   (sigmoid_cross_entropy_with_logits,
                                                finite where log(sigmoid(z)) would underflow)
    softmax:         -log p[y]                 keras.losses.(sparse_)categorical_crossentropy
    sigmoid:         mean over the K units of -y log p - (1 - y) log(1 - p), y in {0, 1}
                     with the outputs' shape (K = 1: also [B] integer labels);
                     keras.losses.binary_crossentropy

Keras computes the probability forms from the logits when the probabilities
come straight from a Softmax/Sigmoid op (it looks through the op), else from
the probabilities clipped to [1e-7, 1 - 1e-7]; mgloop also looks through the
host's concatenation of per-device Softmax/Sigmoid outputs (`colocate`), so that
the one loss sees what one device's Keras loss would. The result has one loss per
example, or per token for outputs [B, L, K] (labels [B, L]); callers take the
mean over all of them. accuracy.py counts correct predictions by the same
reading of the outputs.
"""

from __future__ import annotations

from absl import logging
import keras
import tensorflow as tf

from mgloop.errors import ConfigError
from mgloop.training import heads


def is_one_hot(y_true: tf.Tensor, outputs: tf.Tensor) -> bool:
    """Labels given as rows over the K > 1 output units (one-hot or soft), not integers."""
    return (outputs.shape[-1] != 1 and y_true.shape.rank == outputs.shape.rank
            and y_true.shape[-1] == outputs.shape[-1])


def class_ids(y_true: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
    """Integer labels with the outputs' shape minus the class axis."""
    return tf.reshape(tf.cast(y_true, tf.int32), tf.shape(outputs)[:-1])


class CrossEntropy:
    """Per-element cross-entropy (see the module docstring) of labels and model outputs
    that are `outputs` ("logits", "softmax" or "sigmoid")."""

    def __init__(self, outputs: str = heads.LOGITS):
        if outputs not in (heads.LOGITS, heads.SOFTMAX, heads.SIGMOID):
            raise ValueError(f"outputs must be logits, softmax or sigmoid, not {outputs!r}")
        self.outputs = outputs

    def __repr__(self) -> str:
        return f"CrossEntropy({self.outputs!r})"

    def __call__(self, y_true, outputs) -> tf.Tensor:
        y_true, outputs = tf.convert_to_tensor(y_true), tf.convert_to_tensor(outputs)
        if self.outputs == heads.LOGITS:
            return self._on_logits(y_true, outputs)
        logits = heads.logits_behind_concat(outputs, self.outputs)  # what Keras would see
        values, from_logits = (outputs, False) if logits is None else (logits, True)
        if self.outputs == heads.SIGMOID:
            labels = tf.reshape(tf.cast(y_true, outputs.dtype), tf.shape(outputs))
            return keras.losses.binary_crossentropy(labels, values, from_logits=from_logits)
        if is_one_hot(y_true, outputs):
            return keras.losses.categorical_crossentropy(
                tf.cast(y_true, outputs.dtype), values, from_logits=from_logits)
        return keras.losses.sparse_categorical_crossentropy(
            class_ids(y_true, outputs), values, from_logits=from_logits)

    @staticmethod
    def _on_logits(y_true: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
        produced_by = heads.activation_of(logits)  # None in eager mode
        if produced_by in (heads.SOFTMAX, heads.SIGMOID):  # a model for_model could not trace
            return CrossEntropy(produced_by)(y_true, logits)
        if logits.shape[-1] == 1:
            labels = tf.reshape(tf.cast(y_true, logits.dtype), tf.shape(logits)[:-1])
            return tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits[..., 0])
        if is_one_hot(y_true, logits):
            return tf.nn.softmax_cross_entropy_with_logits(
                labels=tf.cast(y_true, logits.dtype), logits=logits)
        return tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=class_ids(y_true, logits), logits=logits)


cross_entropy = CrossEntropy(heads.LOGITS)  # the default; resolved per model by for_model


def for_model(loss_fn, model: keras.Model, input_shape=None):
    """The loss a Trainer of `model` uses: the default `cross_entropy` matched to the
    model's output activation (heads.py), any other loss unchanged."""
    if loss_fn is not cross_entropy:
        return loss_fn
    activation = heads.output_activation(model, input_shape)
    if activation is None:
        logging.warning("the default loss could not trace the model to read its output "
                        "activation: it reads it from each traced step instead (heads.py)")
    if activation in (None, heads.LOGITS):
        return cross_entropy
    logging.info("default loss: cross-entropy on the %s probabilities the model outputs",
                 activation)
    width = model.outputs[0].shape[-1] if getattr(model, "outputs", None) else None
    if activation == heads.SOFTMAX and width == 1:
        raise ConfigError("model_fn: the model ends in a softmax over one unit, which is "
                          "always 1; end it in a sigmoid (or no activation) for two classes")
    return CrossEntropy(activation)


def select(structure, key):
    """One output's part of a model's outputs (or of the labels): `key` an OutputKey (a
    dict is read by its name, a list or tuple by its index), or None for all of it."""
    if key is None:
        return structure
    if isinstance(structure, dict):
        return structure[key.name]
    if isinstance(structure, (list, tuple)):
        return structure[key.index]
    raise ConfigError(f"output {key.name!r}: the model's outputs (or labels) are one tensor, "
                      "not a list or dict of outputs; give one loss, not a loss per output")


class OutputKey(tuple):
    """(name, index) of one output of a model with several."""

    name = property(lambda self: self[0])
    index = property(lambda self: self[1])


def output_keys(model, names) -> list[OutputKey]:
    """Keys of the outputs `names` refers to: int positions (a list of losses) or output
    names (a dict, matched to `model.output_names` for a model that outputs a list)."""
    model_names = list(getattr(model, "output_names", None) or [])
    keys = []
    for position, name in enumerate(names):
        if isinstance(name, int):
            label = model_names[name] if name < len(model_names) else f"output_{name}"
            keys.append(OutputKey((label, name)))
        elif name in model_names:
            keys.append(OutputKey((name, model_names.index(name))))
        else:
            keys.append(OutputKey((name, position)))
    return keys


class PerOutput:
    """The loss of a model with several outputs, as `keras.Model.compile(loss=[...] or
    {...}, loss_weights=...)` computes it:

        loss = sum over outputs o of w_o * mean over the shard's elements of loss_o(y_o, z_o)

    (w_o = 1 unless weighted; an output whose loss is None adds nothing). It is returned
    per example where every term can be: l_i = sum_o w_o * (mean of loss_o over example
    i's elements), whose mean over the shard is the loss above (every example has the same
    number of elements); a Keras Loss object with Keras's default reduction
    ("sum_over_batch_size") gives its unreduced values (`Loss.call`, labels and outputs
    converted to its dtype as its __call__ does). A term that is one value per batch
    makes the whole loss one value (then short batches cannot be padded: data/padding.py
    refuses). Every term is a mean over its shard, so the towers' mean of it is the
    one-device value on the global batch (shards are equal). `losses` and `weights`: a
    list (by position) or a dict (by output name), as compile takes them."""

    def __init__(self, losses, weights=None, model=None):
        names = list(losses) if isinstance(losses, dict) else list(range(len(losses)))
        given = list(losses.values()) if isinstance(losses, dict) else list(losses)
        if weights is None:
            weights = [1.0] * len(given)
        elif isinstance(weights, dict):
            unknown = set(weights) - set(names)
            if unknown:
                raise ConfigError(f"loss_weights names outputs {sorted(unknown)} that have no "
                                  f"loss; valid: {names}")
            weights = [float(weights.get(n, 1.0)) for n in names]
        elif len(weights) != len(given):
            raise ConfigError(f"loss_weights has {len(weights)} entries for {len(given)} "
                              "losses; give one weight per output")
        keys = output_keys(model, names)
        self.terms = [(key, keras.losses.get(loss) if isinstance(loss, str) else loss,
                       float(weight))
                      for key, loss, weight in zip(keys, given, weights) if loss is not None]
        if not self.terms:
            raise ConfigError("loss: every output's loss is None; give at least one")

    def __repr__(self) -> str:
        return "PerOutput(" + ", ".join(f"{k.name}: {l!r} x {w:g}" for k, l, w in self.terms) + ")"

    def __call__(self, y_true, outputs) -> tf.Tensor:
        terms = [(weight, _per_example(loss_fn, select(y_true, key), select(outputs, key)))
                 for key, loss_fn, weight in self.terms]
        if any(values.shape.rank == 0 for _, values in terms):
            return tf.add_n([weight * tf.reduce_mean(values) for weight, values in terms])
        return tf.add_n([weight * values for weight, values in terms])


def _per_example(loss_fn, y_true, outputs) -> tf.Tensor:
    """`loss_fn`'s values per example ([B]: the mean over each example's other axes), or one
    value ([]) where the loss reduces the batch itself."""
    if isinstance(loss_fn, keras.losses.Loss) and loss_fn.reduction == "sum_over_batch_size":
        convert = lambda v: tf.cast(v, loss_fn.dtype)  # noqa: E731 -- as Loss.__call__ does
        values = loss_fn.call(tf.nest.map_structure(convert, y_true),
                              tf.nest.map_structure(convert, outputs))
    else:
        values = loss_fn(y_true, outputs)
    values = tf.convert_to_tensor(values)
    if values.shape.rank is not None and values.shape.rank > 1:
        values = tf.reduce_mean(values, axis=list(range(1, values.shape.rank)))
    return values
