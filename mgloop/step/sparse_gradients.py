"""Sparse gradients: an Embedding's rows travel as rows where that moves fewer bytes.

The gradient of a gathered table W [V, D] (keras.layers.Embedding) with respect to
W is a `tf.IndexedSlices`: n rows of values [n, D] and their indices [n] (one row
per looked-up token of the shard, repeats included). Sent as it is, tower t moves

    S_t = n_t D w + n_t i   bytes   (w: the transport dtype's size, i: the indices')

instead of the dense gradient's D_v = V D w. Where the rows meet, a device adds
every tower's rows in tower order into one dense [V, D] sum (unsorted segment
sum, local: no traffic), scaled by 1/T: the same mean gradient as the dense
exchange, so N towers still equal one device to float tolerance. Two routes:

    home       a shared layout whose method sums at each variable's home (ps_cpu,
               ps_device, ps_spread: `sums_at_home`): each tower sends its rows to
               the home once, through the method's own reduce (`Aggregation.send`
               moves IndexedSlices and counts values + indices exactly).
               Kept sparse where S_t < D_v.
    all-gather a replicated layout of an exact method in one process: the rows of
               every tower go to every other copy ((T-1) S_t sent per tower), each
               copy adds them in the same tower order, so the copies stay
               bit-identical; the method's reduce never sees the variable.
               Kept sparse where (T-1) S_t < 2 (T-1)/T D_v, the bytes a tower sends in
               a bandwidth-optimal (ring) all-reduce of the dense gradient.

Everywhere else (`--sparse_as_dense`, as Horovod's; lossy or non-exchanging methods;
several workers; the single-loss step; shapes not known when the step is traced) the
rows are added into a dense gradient on the tower's own device before the exchange,
and the method moves that.
"""

from __future__ import annotations

from absl import logging
import tensorflow as tf

from mgloop.aggregation.base import REPLICATED, SHARED, Aggregation

HOME, ALL_GATHER = "home", "all_gather"


def is_sparse(value) -> bool:
    return isinstance(value, tf.IndexedSlices)


def sparse_bytes(rows: tf.IndexedSlices, value_dtype: tf.DType) -> int | None:
    """Bytes of the rows sent as values (in `value_dtype`) and indices (their own dtype);
    None where the number of rows is not known when the step is traced."""
    count = rows.values.shape.num_elements()
    if count is None:
        return None
    return count * value_dtype.size + rows.indices.shape.num_elements() * rows.indices.dtype.size


def to_dense(rows: tf.IndexedSlices, shape: tf.TensorShape) -> tf.Tensor:
    """sum over the rows of values[r] added into row indices[r] of zeros(shape)."""
    return tf.math.unsorted_segment_sum(rows.values, rows.indices, shape[0])


def route(aggregation: Aggregation, sparse_as_dense: bool) -> str | None:
    """HOME, ALL_GATHER or None (dense) for this method and setting (module docstring)."""
    caps = aggregation.capabilities
    if sparse_as_dense or caps.single_loss or not caps.exchanges:
        return None
    if aggregation.cluster is not None or not caps.exact:
        return None
    if caps.layout == SHARED and caps.sums_at_home:
        return HOME
    if caps.layout == REPLICATED and aggregation.num_towers > 1:
        return ALL_GATHER
    return None


def keeps_sparse(route_name: str | None, rows: tf.IndexedSlices, variable,
                 aggregation: Aggregation) -> bool:
    """Whether the route moves fewer bytes with `rows` than with the dense gradient."""
    if route_name is None:
        return False
    wire = aggregation.transport_dtype if variable.dtype.is_floating else variable.dtype
    sparse = sparse_bytes(rows, wire)
    if sparse is None:
        return False
    dense = variable.shape.num_elements() * wire.size
    towers = aggregation.num_towers
    if route_name == HOME:
        return sparse < dense
    return (towers - 1) * sparse < 2 * (towers - 1) / towers * dense


class Plan:
    """Which of a step's IndexedSlices gradients stay sparse (`kept`), made when the step
    is traced from the first tower's gradients; the others are densified on each tower."""

    def __init__(self, aggregation: Aggregation, variables, sparse_as_dense: bool):
        self.aggregation, self.variables = aggregation, list(variables)
        self.route = route(aggregation, sparse_as_dense)
        self.kept: list[int] = []  # of the last traced step (for reports and tests)

    def prepare(self, tower_grads, excluded=()) -> list[list]:
        """The towers' gradients with every IndexedSlices not kept made dense on its tower
        (variables in `excluded`, e.g. summed at their homes already, are left as given)."""
        first = tower_grads[0]
        kept = [i for i, g in enumerate(first) if is_sparse(g) and i not in excluded
                and all(keeps_sparse(self.route, grads[i], self.variables[i], self.aggregation)
                        for grads in tower_grads)]
        if kept != self.kept:
            logging.info("sparse gradients: variables %s travel as rows (%s)", kept, self.route)
        self.kept = kept
        out = []
        for grads, device in zip(tower_grads, self.aggregation.devices.towers):
            with tf.device(device):
                out.append([to_dense(g, self.variables[i].shape)
                            if is_sparse(g) and i not in kept and i not in excluded else g
                            for i, g in enumerate(grads)])
        return out

    def all_gather(self, tower_grads, index: int, devices, average: bool) -> list[tf.Tensor]:
        """(1/T) sum_t of the towers' rows of variable `index`, formed on every device of
        `devices` from every tower's rows sent there, added in tower order."""
        method, towers = self.aggregation, self.aggregation.devices.towers
        shape = self.variables[index].shape
        out = []
        for device in devices:
            received = [method.send(grads[index], src, device)
                        for grads, src in zip(tower_grads, towers)]
            with tf.device(device):
                rows = tf.IndexedSlices(tf.concat([r.values for r in received], 0),
                                        tf.concat([r.indices for r in received], 0))
                out.append(method.scale(to_dense(rows, shape), average))
        return out
