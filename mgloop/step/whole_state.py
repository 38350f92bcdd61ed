"""The whole optimizer state of a sharded update, built for one checkpoint save or restore.

A checkpoint holds copy 0's optimizer whole, as a run without --shard_update saves it, so
either kind of run resumes from the other's. `WholeState` learns once how Keras lays out
that optimizer for a checkpoint: a probe optimizer, built over one-entry stand-ins of copy
0's variables, shows which of its variables is slot k of variable i and which are its own
(the step count, a rate), and under which names it holds them. For each save or restore
`holder()` builds, on the host, plain tf.Variables of the whole shapes in that layout
(`_trackable_children`, TensorFlow's object graph); the sharded update gathers every
piece's slots into them, or scatters them out, and the holder is dropped after. Plain
variables, because each Keras variable made per save would keep memory that no
collection frees (`python -m experiments.memory variables`: about 35 KiB per
`keras.Variable`, none per `tf.Variable`, whatever their size).
"""

from __future__ import annotations

import collections.abc

import tensorflow as tf

from mgloop.training import optim


class WholeState:
    """The layout of copy 0's whole optimizer over `variables` (copy 0's trainable ones)."""

    def __init__(self, optimizer_fn, variables, host: str):
        self.variables, self.host = list(variables), host
        with tf.device(host):
            self.stand_ins = [tf.Variable(tf.zeros([1], v.dtype), name="stand_in")
                              for v in self.variables]
            self.probe = optimizer_fn()
            optim.colocate_with_variables(self.probe, place=False)
            self.probe.build(self.stand_ins)
        table = self.probe.mgloop_slots
        self.slot_of = {id(slot): (i, kind) for i, stand_in in enumerate(self.stand_ins)
                        for kind, slot in enumerate(table.get(id(stand_in), []))}

    def holder(self) -> tuple[object, dict, list]:
        """(a trackable laid out as the whole optimizer, {(variable, kind): its slot}, its
        other variables in the optimizer's order), every value zero, on the host."""
        made, slots, others = {}, {}, []
        with tf.device(self.host):
            for v in self.probe.variables:
                if id(v) in self.slot_of:
                    i, kind = self.slot_of[id(v)]
                    target = self.variables[i]
                    slots[(i, kind)] = made[id(v)] = tf.Variable(
                        tf.zeros(target.shape, target.dtype), trainable=False)
                else:
                    made[id(v)] = tf.Variable(tf.zeros(v.shape, tf.as_dtype(v.dtype)),
                                              trainable=False)
                    others.append(made[id(v)])
        for stand_in, variable in zip(self.stand_ins, self.variables):
            made[id(stand_in)] = variable  # the optimizer refers to the model's variables
        holder = tf.__internal__.tracking.AutoTrackable()
        for name, child in self.probe._trackable_children().items():
            setattr(holder, name, _mapped(child, made))
        return holder, slots, others


def _mapped(child, made: dict):
    """`child` of the probe with each of its variables replaced by the holder's."""
    if id(child) in made:
        return made[id(child)]
    if isinstance(child, collections.abc.Mapping):
        return {key: _mapped(value, made) for key, value in child.items()}
    if isinstance(child, (list, tuple)):
        return [_mapped(value, made) for value in child]
    return child
