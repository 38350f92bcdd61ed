"""The model's variables and their copies on devices.

There is one template Keras model; its variables are copy 0. A replicated layout adds
one plain `tf.Variable` copy per further device, created there from the template's
initial values (`make_copies`); `copy_first_to_rest` makes every copy equal to copy 0
again (after a restore). The run's global step (`global_step_on`) is made here too. Here,
below the step and the methods, because both the aggregation methods (local SGD, DiLoCo,
nodes) and the optimizers read copies, and the methods read the step the replicas advance.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf


def global_step_on(host: str) -> tf.Variable:
    """The run's global step on `host` (int64: the steps done before the one running;
    checkpointed). Made before the aggregation method, which takes it at construction and
    reads it; the replicas advance it."""
    with tf.device(host):
        return tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step")


@dataclasses.dataclass
class VariableCopy:
    """One copy of the model's variables on one device, with its own optimizer state."""

    device: str
    trainable: list[tf.Variable]
    non_trainable: list[tf.Variable]
    optimizer: keras.optimizers.Optimizer | None = None

    @property
    def variables(self) -> list[tf.Variable]:
        return self.trainable + self.non_trainable



def backing(variable) -> tf.Variable:
    """The tf.Variable behind a Keras variable (the object TensorFlow places)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def make_copies(template: keras.Model, devices: list[str]) -> list[VariableCopy]:
    """Copy 0 is the template's own variables (built on devices[0]); then one per device."""
    first = VariableCopy(devices[0],
                         [backing(v) for v in template.trainable_variables],
                         [backing(v) for v in template.non_trainable_variables])
    copies = [first]
    for index, device in enumerate(devices[1:], start=1):
        with tf.device(device):
            def clone(source, trainable):
                name = f"replica_{index}/{source.name.split(':')[0]}"
                return tf.Variable(source.read_value(), trainable=trainable, name=name)
            copies.append(VariableCopy(device,
                                       [clone(v, True) for v in first.trainable],
                                       [clone(v, False) for v in first.non_trainable]))
    return copies


def copy_first_to_rest(copies: list[VariableCopy], slots: bool = True) -> None:
    """Makes every copy (variables, and unless not `slots` optimizer state) equal to copy 0,
    e.g. after a restore."""
    first = copies[0]
    first_slots = first.optimizer.variables if first.optimizer and slots else []
    for copy in copies[1:]:
        copy_slots = copy.optimizer.variables if copy.optimizer and slots else []
        for target, source in zip(copy.variables + copy_slots, first.variables + first_slots):
            target.assign(backing(source).read_value())
