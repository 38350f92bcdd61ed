"""The FLOPs of a traced graph, counted from its matrix products and convolutions.

A walk over the graph's operations (a concrete function's `graph`), each counted from its
static shapes as 2 FLOPs per multiply-add:

    MatMul, BatchMatMul{,V2,V3}   2 * |output| * K          K the contracted dimension
                                                            (of a, after its transpose/adjoint)
    Einsum (two operands)         2 * prod_{labels} size    every label of the equation once:
                                                            the loop nest of the contraction
    Conv2D, Conv3D                2 * |output| * k * C_in   k the kernel's spatial size,
                                                            C_in the filter's input channels
    Conv{2,3}DBackpropInput       2 * |out_backprop| * k * C_in  (the forward's count)
    Conv{2,3}DBackpropFilter      2 * |out_backprop| * k * C_in
    DepthwiseConv2dNative (and    2 * |output or out_backprop| * k
      its two backprops)

|t| the elements of a tensor. Only the ops the function's outputs need are counted: the
gradient of the first layer with respect to the input, which a convolution's gradient
traces but no output reads, is pruned before the function runs (TensorFlow's Grappler),
and is not counted. Left out: element-wise ops (additions, biases,
activations, softmax, normalisation), reductions, gathers (embeddings), the loss, and
anything inside a function call or control flow (While, If, PartitionedCall: their
bodies are not walked; such ops are listed as `uncounted`, as are products whose shapes
are not static). This is the count of the standard estimates (Kaplan et al. 2020,
arXiv 2001.08361, table 1; Chowdhery et al. 2022, arXiv 2204.02311, appendix B), which
count the products alone. TensorFlow's own profiler (tf.compat.v1.profiler with
ProfileOptionBuilder.float_operation(), profiler/internal/flops_registry.py) is not
used: it has no count for Einsum, which Keras's MultiHeadAttention computes its scores
and weighted values with, and it adds element-wise ops the estimates leave out.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import tensorflow as tf

MATMULS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
CONVS = ("Conv2D", "Conv3D", "Conv2DBackpropInput", "Conv3DBackpropInputV2",
         "Conv2DBackpropFilter", "Conv3DBackpropFilterV2")
DEPTHWISE = ("DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput",
             "DepthwiseConv2dNativeBackpropFilter")
CALLS = ("While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
         "PartitionedCall", "StatefulPartitionedCall")


@dataclasses.dataclass
class Count:
    """FLOPs of the counted ops, per op type, and the op types left uncounted."""

    flops: int = 0
    by_type: dict = dataclasses.field(default_factory=collections.Counter)
    uncounted: list = dataclasses.field(default_factory=list)


def _dims(tensor) -> list[int] | None:
    shape = tensor.shape
    if shape.rank is None or any(d is None for d in shape.as_list()):
        return None
    return shape.as_list()


def _matmul(op) -> int | None:
    a, out = _dims(op.inputs[0]), _dims(op.outputs[0])
    if a is None or out is None:
        return None
    flags = ("transpose_a", "adj_x")
    transposed = any(op.node_def.attr[f].b for f in flags if f in op.node_def.attr)
    return 2 * math.prod(out) * (a[-2] if transposed else a[-1])


def _einsum(op) -> int | None:
    equation = op.get_attr("equation").decode()
    operands = equation.split("->")[0].split(",")
    if len(operands) != 2 or "." in equation:
        return None
    sizes = {}
    for labels, tensor in zip(operands, op.inputs):
        dims = _dims(tensor)
        if dims is None or len(dims) != len(labels):
            return None
        sizes.update(zip(labels, dims))
    return 2 * math.prod(sizes.values())


def _conv(op) -> int | None:
    """2 * |product side| * k * C_in, the product side being the forward output (Conv) or
    out_backprop (both backprops, input 2); the filter its input 1 (or the output of a
    filter's backprop)."""
    backprop = "Backprop" in op.type
    side = _dims(op.inputs[2] if backprop else op.outputs[0])
    kernel = _dims(op.outputs[0] if "BackpropFilter" in op.type else op.inputs[1])
    if side is None or kernel is None:
        return None
    spatial = math.prod(kernel[:-2])
    per_output = spatial if op.type.startswith("Depthwise") else spatial * kernel[-2]
    return 2 * math.prod(side) * per_output


def _needed(graph) -> list:
    """The ops the graph's outputs depend on (through data or control inputs), in graph
    order: what runs once TensorFlow's graph optimiser (Grappler) prunes the rest."""
    stack = [t.op for t in graph.outputs] + list(graph.control_outputs)
    seen = set()
    while stack:
        op = stack.pop()
        if op.name not in seen:
            seen.add(op.name)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
    return [op for op in graph.get_operations() if op.name in seen]


def count(graph: tf.Graph) -> Count:
    """The FLOPs of the matrix products and convolutions that a function graph's outputs
    need (module top)."""
    result = Count()
    for op in _needed(graph):
        if op.type in MATMULS:
            flops = _matmul(op)
        elif op.type == "Einsum":
            flops = _einsum(op)
        elif op.type in CONVS or op.type in DEPTHWISE:
            flops = _conv(op)
        elif op.type in CALLS:
            flops = None
        else:
            continue
        if flops is None:
            result.uncounted.append(op.type)
        else:
            result.flops += flops
            result.by_type[op.type] += flops
    return result
