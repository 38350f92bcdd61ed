"""`--optimizer=muon`: Keras's own Muon, and which variables its AdamW part takes, decided
once and held on every variable copy.

Keras's Muon (keras/src/optimizers/muon.py; Jordan et al. 2024, Moonlight's scale: Liu et al.
2025, arXiv 2502.16982) updates a matrix W (a 2-D variable not given to AdamW) from its
momentum buffer m, with momentum mu = --momentum and rate lr = --learning_rate's schedule:

    m <- mu m + g;   G = g + mu m   (Nesterov);   X = G / (||G||_F + 1e-7)
    5 times: A = X X^T;  X <- a X + (b A + c A A) X     (a, b, c = 3.4445, -4.7750, 2.0315;
                                                       X^T first if rows > cols)
    W <- W - lr X rms_rate sqrt(max(rows, cols))        (--muon_rms_rate; 0: no scale)

X is a whole-matrix function of G (Newton-Schulz: approximately U V^T of G's SVD), so a
chunk of W cannot be updated apart: --shard_update is refused (training/options.py). Every
other variable takes the AdamW part: Adam on m (beta_1 0.9, beta_2 0.999, epsilon
--adam_epsilon) at rate lr * --muon_adam_lr_ratio. Decoupled weight decay, v <- v - lr wd v,
wd = --weight_decay on both parts (Keras's weight_decay and adam_weight_decay).

Which variables the AdamW part takes is Keras's rule (`Muon._should_use_adamw`): a variable
of ndim != 2, one whose path contains "embedding" (any case), or one in whose path a pattern
of `exclude_layers` is found (re.search). The flag-made Muon (`make`) also gives it the
output layer, as MuLoCo does (DiLoCo with Muon inside, Therien et al. 2025, arXiv
2505.23725) and Keras's docstring advises: one pattern per 2-D weight of the layers that
make the model's outputs (`output_kernels`), `(?:^|/)<its path>$`, found in the path of the
template's variable ("mlp/dense_2/kernel") and of every copy's ("replica_1/mlp/...").

On every copy. Keras's Muon decides at build (a velocity slot made, or not) and at each
weight decay, on `variable.path`; mgloop's copies are tf.Variables, which have no path (copy 0
the template's variables' own, named by their paths "mlp/dense_2/kernel:0"; copy k clones
named "replica_k/mlp/dense_2/kernel:0"), and a user's pattern anchored at ^ would decide a
clone otherwise. So the split is decided once, by copy 0's optimizer's own rule on copy 0's
variables seen with their paths (`adamw_part`), and each copy's optimizer, copy 0's
included, is told it by identity (`splitting_like`, as weight decay is: optim.py); after
build, each copy's velocity slots are checked against it, and a class whose build decides
otherwise is refused in one line (`check_split`).
"""

from __future__ import annotations

import re

from absl import logging
import keras

from mgloop.errors import ConfigError
from mgloop.training.options import OptimOptions


def make(options: OptimOptions, schedule, output_kernels=()) -> keras.optimizers.Muon:
    """Keras's Muon of the flags (module docstring), the output layer's weights (their
    paths, `output_kernels`) given to its AdamW part."""
    decay = options.weight_decay or None
    return keras.optimizers.Muon(
        schedule, momentum=options.momentum, epsilon=options.adam_epsilon,
        weight_decay=decay, adam_weight_decay=decay,
        adam_lr_ratio=options.muon_adam_lr_ratio, rms_rate=options.muon_rms_rate or None,
        exclude_layers=[exclude_pattern(path) for path in output_kernels])


def exclude_pattern(path: str) -> str:
    """The `exclude_layers` pattern found in exactly `path` and its copies' "replica_k/" path."""
    return "(?:^|/)" + re.escape(path) + "$"


def output_kernels(model: keras.Model) -> tuple[str, ...]:
    """The paths of the 2-D trainable weights of the layers that make `model`'s outputs
    (each output's layer, as its Functional or Sequential graph records it). Refuses (one
    line) a model whose outputs are not traced, or made by an op without such a weight:
    mgloop cannot tell which layer is the output. A nested model's output: its own layer's."""
    try:
        outputs = keras.tree.flatten(model.outputs)
    except (AttributeError, ValueError):  # a subclassed model: no graph of its outputs
        outputs = []
    paths = []
    for output in outputs:
        layer = _producer(output)
        kernels = [v.path for v in getattr(layer, "trainable_variables", ()) if len(v.shape) == 2]
        if not kernels:
            outputs = []
            break
        paths += kernels
    if not outputs:
        raise ConfigError(
            f"--optimizer=muon: the output layer of model {model.name!r} is not a layer with "
            "a 2-D weight of its graph (a subclassed model, or an op), so mgloop cannot give "
            "it to Muon's AdamW part; give your own keras.optimizers.Muon(exclude_layers="
            "[...]) to mgloop.run(optimizer=...)")
    return tuple(paths)


def _producer(tensor):
    """The layer that makes a symbolic `tensor`: inside a nested Functional model, its own."""
    operation, _, index = tensor._keras_history
    if isinstance(operation, keras.Model) and getattr(operation, "outputs", None):
        return _producer(keras.tree.flatten(operation.outputs)[index])
    return operation


class _WithPath:
    """A copy's tf.Variable as Keras's rule reads a Keras variable: its `path` (its name
    without ':0'), everything else its own."""

    def __init__(self, variable):
        self._variable = variable
        self.path = variable.name.split(":")[0]

    def __getattr__(self, name):
        return getattr(self._variable, name)


def adamw_part(optimizer: keras.optimizers.Optimizer, variables) -> list[bool] | None:
    """Whether `optimizer` (a Muon) gives each of `variables` (copy 0's: the template's) to
    its AdamW part, by its own rule on their paths; None for any other optimizer."""
    if not isinstance(optimizer, keras.optimizers.Muon):
        return None
    try:
        decided = [bool(optimizer._should_use_adamw(
            v if isinstance(v, keras.Variable) else _WithPath(v))) for v in variables]
    except re.error as error:
        raise ConfigError(f"optimizer: {type(optimizer).__name__}'s exclude_layers holds a "
                          f"pattern that is not a regular expression ({error}); give Python "
                          "regular expressions (re.escape a plain path)") from None
    if decided and all(decided):
        logging.warning("%s: every variable is given to its AdamW part (none is a 2-D weight "
                        "but the excluded: embeddings, exclude_layers, the output layer), so "
                        "this run trains with AdamW alone", type(optimizer).__name__)
    return decided


def splitting_like(optimizer: keras.optimizers.Muon, variables, decided) -> None:
    """Makes `optimizer` (not built) give variables[i] to its AdamW part exactly when
    decided[i], by identity (its `_should_use_adamw`, replaced on the instance: no name or
    path matters)."""
    table = {optimizer._var_key(v): bool(d) for v, d in zip(variables, decided)}
    optimizer._should_use_adamw = lambda variable: table[optimizer._var_key(variable)]


def check_split(optimizer: keras.optimizers.Muon, variables, decided) -> None:
    """Refuses (one line) a built `optimizer` whose AdamW velocities are not those of
    `decided` (a class whose build decides its split by a rule of its own)."""
    made = [optimizer.adam_velocities[optimizer._get_variable_index(v)] is not None
            for v in variables]
    differs = [v.name for v, want, got in zip(variables, decided, made)
               if want != got and not optimizer._overwrite_variable_with_gradient(v)]
    if differs:
        raise ConfigError(
            f"optimizer: {type(optimizer).__name__}'s build decides which variables its "
            f"AdamW part takes by a rule of its own, and decides {differs[0]} unlike the "
            "template's variable; decide it in _should_use_adamw (or use Keras's Muon's "
            "exclude_layers and exclude_embeddings)")
