"""pfor (`tf.vectorized_map`) with its loop fallbacks named and its failures refused.

`tf.vectorized_map(f, elems, fallback_to_while_loop=True)` converts every op of f into
one op over the leading axis; an op it has no rule for runs in a `tf.while_loop` over the
rows instead, with a warning per op. `vectorized_map` here logs those ops once per
computation (which ran as a loop, never silently) and turns a conversion that fails even
so into one ConfigError line; `probe` traces a model's forward and backward pass over two
rows before anything is built and names the layer that cannot be vectorized
(vectorized_towers.py maps a device's towers so).
"""

from __future__ import annotations

import contextlib
import logging as py_logging
import re

from absl import logging
import keras
import tensorflow as tf

from mgloop.errors import ConfigError
from mgloop.training.variables import backing
from mgloop.step import per_tower

_FALLBACK = re.compile(r"Using a while_loop for converting (\w+)")


class _Fallbacks(py_logging.Handler):
    """Collects the ops pfor converted by a while_loop (TensorFlow logs each as a warning)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def emit(self, record):
        match = _FALLBACK.search(record.getMessage())
        if match and match.group(1) not in self.ops:
            self.ops.append(match.group(1))


@contextlib.contextmanager
def _collect_fallbacks():
    handler, quiet, logger = _Fallbacks(), _Quiet(), tf.get_logger()
    logger.addHandler(handler)
    logger.addFilter(quiet)  # said once by `vectorized_map` below, not once per op by pfor
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.removeFilter(quiet)


class _Quiet(py_logging.Filter):
    def filter(self, record):
        return not _FALLBACK.search(record.getMessage())


def vectorized_map(fn, elems, what: str):
    """`tf.vectorized_map(fn, elems)` with a loop fallback for ops pfor cannot vectorize,
    logged once (`what` names the computation); an op that cannot run even so is refused
    (ConfigError naming the op and its layer)."""
    with _collect_fallbacks() as fallbacks:
        try:
            out = tf.vectorized_map(fn, elems, fallback_to_while_loop=True)
        except ConfigError:
            raise
        except Exception as error:  # pfor's conversion failed, whatever the op raised
            raise ConfigError(f"--towers_per_device: {what} cannot be vectorized over the "
                              f"towers of a device: {_first_line(error)}; use "
                              "--towers_per_device=1 (one traced pass per tower)") from None
    if fallbacks.ops:
        logging.info("--towers_per_device: %s: %d op type(s) have no vectorized form and run "
                     "in a loop over the towers of a device (same results, slower): %s", what,
                     len(fallbacks.ops), ", ".join(fallbacks.ops))
    return out


def _first_line(error: Exception) -> str:
    """The error's last line (TensorFlow's own message, after the traced frames)."""
    text = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {text[-1] if text else ''}"


def probe(model, input_shape) -> None:
    """Refuses (ConfigError, one line naming the op and layer) a model whose forward and
    backward pass pfor cannot vectorize over two towers, before any variable copy exists;
    logs the ops that will run in a loop."""
    if input_shape is None:
        return
    trainable = [backing(v) for v in model.trainable_variables]
    state = [backing(v) for v in model.non_trainable_variables]
    kwargs = per_tower.call_kwargs(model, True)

    @tf.function
    def trace():
        values = [v.read_value() for v in trainable]
        fixed = [v.read_value() for v in state]

        def one_tower(x_t):
            with tf.GradientTape() as tape:
                tape.watch(values)
                outputs, _ = model.stateless_call(values, fixed, x_t, **kwargs)
                total = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32))
                                  for o in tf.nest.flatten(outputs)])
            return [tf.convert_to_tensor(g) for g in tape.gradient(
                total, values, unconnected_gradients=tf.UnconnectedGradients.ZERO)]
        return vectorized_map(one_tower, tf.zeros((2, 1, *input_shape), _input_dtype(model)),
                              f"the towers' pass of {model.name!r}")
    try:
        trace.get_concrete_function()
    except Exception as error:  # autograph wraps the ConfigError raised while tracing
        found = re.search(r"ConfigError: (--towers_per_device: .*)", str(error))
        if found is None:
            raise
        line, layer = found.group(1), _failing_layer(model)
        if layer is not None:
            line = line.replace(f"the towers' pass of {model.name!r}",
                                f"layer {layer!r} of {model.name!r}")
        raise ConfigError(line) from None


def _input_dtype(model) -> tf.DType:
    inputs = getattr(model, "inputs", None)
    return tf.as_dtype(inputs[0].dtype) if inputs else tf.float32


def _failing_layer(model) -> str | None:
    """The name of the first layer whose own forward and backward pass pfor cannot
    vectorize (each layer alone, on zeros of its input's shape), or None."""
    for layer in model.layers:
        spec = getattr(layer, "input", None)
        if not isinstance(spec, keras.KerasTensor) or not layer.built:
            continue

        @tf.function
        def trace(layer=layer, spec=spec):
            weights = [backing(v).read_value() for v in layer.trainable_variables]
            state = [backing(v).read_value()
                     for v in layer.non_trainable_variables]

            def one(x_t):
                with tf.GradientTape() as tape:
                    tape.watch(weights)
                    tape.watch(x_t)
                    out, _ = layer.stateless_call(weights, state, x_t)
                    total = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32))
                                      for o in tf.nest.flatten(out)])
                return tape.gradient(total, [x_t] + weights,
                                     unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return tf.vectorized_map(one, tf.zeros((2, 1, *spec.shape[1:]), spec.dtype),
                                     fallback_to_while_loop=True)
        try:
            with _collect_fallbacks():
                trace.get_concrete_function()
        except Exception:  # pfor's conversion failed in this layer
            return layer.name
    return None
