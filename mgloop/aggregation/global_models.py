"""The model a method produces: what is evaluated, predicted with, exported and returned.

Between its synchronisations a method whose copies differ (`copies_differ`) holds N node
replicas v_c, none of which is "the model"; each method names the one it produces
(`Aggregation.global_model(copies)`, its words in `global_model_name`, summary.json's
"evaluated_model"), and runs/inference.py builds it on the side, in an evaluation copy,
never writing a training variable:

    exact methods      copy 0, w = v_0 (every copy applies the same update: all equal)
    localsgd, sparta   the nodes' mean, w = (1/N) sum_c v_c (`mean_of`); right after a
                       sync every copy holds it (sparta: only the drawn elements agree)
    diloco, sparseloco, sparta_diloco
                       the outer parameters x of the last outer step (`start`: the same
                       bits on every copy), as the papers evaluate, not the replicas'
                       inner progress since it
    streaming_diloco   x, each fragment as of its own last outer step (synced at
                       different steps, up to H - H/P apart); with tau > 0 a fragment's x
                       already holds the outer step computed at its send, not yet merged
    ... eager=true     the mean of the nodes' x_c, w = (1/N) sum_c x_c (they differ by
                       each copy's own fresh share; mgloop's choice: the paper names no one
                       model between its workers' outer parameters)
    one node           the copy itself (nothing is synced; x is never stepped)
    independent        copy 0, tower 0's own model (it trains one model per tower)

Between worker processes (each worker a node, peers.py) x is on every worker, but a mean
over the nodes would need a collective at every evaluation, the final one included, which
runs after the workers' collectives have stopped: there each worker takes its own node's
copy (or x_c), and the name says so. The mean is summed on copy 0's device in copy order
and scaled by fl(1/N) (for N = 2 the correctly rounded mean), read by no `send`: an
evaluation moves nothing a step counts.
"""

from __future__ import annotations

import tensorflow as tf


def mean_of(per_copy: list[list], device: str) -> list[tf.Tensor]:
    """(1/N) sum_c per_copy[c][i] for every i (variables or tensors of one dtype per i),
    each read where it lives, summed on `device` in copy order, then times fl(1/N)."""
    values = [[tf.convert_to_tensor(v) for v in values] for values in per_copy]
    with tf.device(device):
        return [tf.add_n([tf.identity(copy[i]) for copy in values])
                * tf.constant(1.0 / len(values), values[0][i].dtype)
                for i in range(len(values[0]))]


class ProducedModel:
    """The contract's part (aggregation/base.py `Aggregation` inherits it) that names the model
    a method produces; a wrapper hands the calls to the method it wraps."""

    def global_model(self, copies) -> list[tf.Tensor]:
        """The trainable values of the model it produces (module top) from `copies` (those it
        holds, copy 0 first), changing none. Default: copy 0's, w = v_0."""
        return [tf.convert_to_tensor(v) for v in copies[0].trainable]

    def global_model_name(self) -> str:
        """`global_model` in words (summary.json's "evaluated_model")."""
        return ("copy 0 (node 0's replica: the method names no global model)"
                if self.capabilities.copies_differ else "copy 0 (every copy equal)")

    def node_copies(self, copies) -> list:
        """Each node's own copy, in node order (--eval_each_node). Default: every copy."""
        return list(copies)
