"""Does the template model take the data's examples? Checked once, before the towers exist.

A Keras functional or Sequential model declares its input shape (`model.inputs`,
e.g. (None, 32) for `keras.Input((32,))`); a batch of examples of shape S
(`InMemoryDataset.input_shape`) reaches it as (b, *S). The model accepts the
batch when it declares one input whose dimensions match (b, *S) one by one, a
declared None matching anything, after the one change of rank Keras makes
itself (`Functional._adjust_input_rank`: a trailing dimension of size 1 is
dropped from the batch or added to it). Anything else would fail inside the
compiled loop with a long traceback, so it is refused in one line here.
A model that declares no inputs (subclassed) is left to its first call.
"""

from __future__ import annotations

import keras

from mgloop.errors import ConfigError


def _fits(declared: tuple, batch: tuple) -> bool:
    if len(batch) == len(declared) + 1 and batch[-1] == 1:
        batch = batch[:-1]
    elif len(batch) == len(declared) - 1 and declared[-1] == 1:
        batch = (*batch, 1)
    return len(batch) == len(declared) and all(
        d is None or d == b for d, b in zip(declared[1:], batch[1:]))


def check_fits_data(model: keras.Model, example_shape: tuple[int, ...]) -> None:
    """Refuses, in one line naming both shapes, a model whose declared input cannot take
    batches of examples of shape `example_shape`."""
    inputs = getattr(model, "inputs", None)
    if not inputs:
        return
    example_shape = tuple(example_shape)
    wanted = f"keras.Input(shape={example_shape})"
    if len(inputs) != 1:
        shapes = ", ".join(str(tuple(x.shape)) for x in inputs)
        raise ConfigError(f"the model takes {len(inputs)} inputs ({shapes}) but the data "
                          f"(--dataset) gives one tensor of examples of shape {example_shape}; "
                          f"give the model one input, {wanted}")
    declared = tuple(inputs[0].shape)
    if not _fits(declared, (None, *example_shape)):
        raise ConfigError(f"the model's input shape {declared} does not fit the data "
                          f"(--dataset): examples of shape {example_shape}, batches "
                          f"{(None, *example_shape)}; build the model on {wanted}")
