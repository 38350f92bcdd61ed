"""A dense kernel's gradient summed over the towers as one product of their factors.

When a variable W (m x n) enters tower t's forward pass only as the right-hand
side of one plain matrix product z_t = x_t W (x_t: b x m, the tower's b = B/T
rows), its gradient there is the rank-b product of two "sufficient factors"
(Xie et al. 2016, "Lighter-Communication Distributed Machine Learning via
Sufficient Factor Broadcasting"; Poseidon's SFB, Zhang et al. 2017):

    g[t][W] = x_t^T dz_t,        dz_t = d loss_t / d z_t   (b x n)

so the sum the aggregation forms on W's home is one product of the stacked factors,

    sum_t g[t][W] = X^T dZ,      X = concat_t x_t (B x m),  dZ = concat_t dz_t (B x n),

and the average (1/T) X^T dZ (`reduce`). Each tower's backward pass
(`TowerForward.gradients`, by `tf.gradients`) is asked for dz_t instead of
g[t][W], so the tower's own x_t^T dz_t is never built; `SufficientFactors`
sends x_t and dz_t to home(W) and multiplies there once. Per tower that moves b(m + n) elements
instead of mn and allocates no m x n gradient: for big_mlp's 8000 x 4000 kernel
on 4 towers of 128 rows, 6 MB instead of 128 MB each, and one 128 MB sum in
all instead of four gradients and their sum. It is the same arithmetic as one
device's backward pass on the whole batch (one product of inner dimension B),
where T products of inner dimension b write T full-size results through one
memory. The terms are added inside one matrix product rather than by AddN, which
can change the last bits of float32. The towers' MatMul ops take mgloop's
gradient (`_matmul_gradient`): TensorFlow's formulas, except that a factored
product's input gradient is formed as dx = (W dz^T)^T, not as dz W^T.

Which variables: those of at least `min_bytes` bytes whose value, in each
tower's traced forward pass, has exactly one consumer, a `MatMul` without transposes
that takes it as its second operand (a Keras `Dense` on float32; not one under
mixed precision, whose kernel passes through a Cast, nor one with a weight
regulariser, whose loss is a second consumer). Found by reading the traced graph
(`find`), so it needs the step to be traced in a `tf.function` (as the compiled
loop is); eager calls keep the plain gradient. It applies where ordered_sum.py
does: a shared layout summed at each variable's home on logical CPU towers.
On GPUs the product would move from the towers to the home device (the CPU for
ps_cpu), a trade that needs measuring there first.
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from mgloop.aggregation.base import Aggregation
from mgloop.step.ordered_sum import num_bytes


Factors = dict[int, tuple[tf.Tensor, tf.Tensor]]  # variable index -> (x_t, dz_t)


MATMUL_GRADIENT = "MgloopFactoredMatMul"  # the gradient of the towers' MatMul ops (below)

_factored_products: set[str] = set()  # names of the factored MatMul ops, during their backward


@tf.RegisterGradient(MATMUL_GRADIENT)
def _matmul_gradient(op: tf.Operation, grad: tf.Tensor):
    """MatMul's gradient (TensorFlow's formulas), but for a factored product z = x W:
    dx = (W dz^T)^T, and no dW (its sum is formed from the factors).

    `gradient_override_map` replaces the gradient of every MatMul a factoring tower
    builds, and TensorFlow has no public way to call its own MatMul gradient, so
    the four transpose cases are written out here (tested against the tape's).

    TensorFlow's dx = dz W^T multiplies by a transposed right operand. On this
    machine's CPUs, for big_mlp's second layer, four towers' products of 128 rows
    take 2.0 times as long that way as with W on the left, and one product of 512
    rows 1.3–1.5 times (experiments/towers.py matmuls; docs/results/systems.md): T towers
    pay TensorFlow's form on b rows each, which costs more than on B rows at once.
    """
    a, b = tf.math.conj(op.inputs[0]), tf.math.conj(op.inputs[1])
    transpose_a, transpose_b = op.get_attr("transpose_a"), op.get_attr("transpose_b")
    if op.name in _factored_products:
        return tf.transpose(tf.matmul(b, grad, transpose_b=True)), None
    if not transpose_a and not transpose_b:
        return tf.matmul(grad, b, transpose_b=True), tf.matmul(a, grad, transpose_a=True)
    if not transpose_a:
        return tf.matmul(grad, b), tf.matmul(grad, a, transpose_a=True)
    if not transpose_b:
        return tf.matmul(b, grad, transpose_b=True), tf.matmul(a, grad)
    return (tf.matmul(b, grad, transpose_a=True, transpose_b=True),
            tf.matmul(grad, a, transpose_a=True, transpose_b=True))


def find(values: Sequence[tf.Tensor], candidates: Sequence[int],
         forward_ops: Sequence[tf.Operation]) -> dict[int, tf.Operation]:
    """The candidates whose value feeds exactly one op of `forward_ops`, a plain MatMul
    taking it as the right operand: index -> that MatMul (z = x W)."""
    forward = set(forward_ops)
    found = {}
    for i in candidates:
        consumers = [op for op in values[i].consumers() if op in forward]
        if len(consumers) != 1:
            continue
        op = consumers[0]
        if (op.type == "MatMul" and op.inputs[1].name == values[i].name
                and op.inputs[0].name != values[i].name
                and not op.get_attr("transpose_a") and not op.get_attr("transpose_b")):
            found[i] = op
    return found


class TowerForward:
    """One tower's forward pass, traced inside `with`: which large kernels it used only
    in a plain product, and its backward pass with those products factored."""

    def __init__(self, plan: "SufficientFactors"):
        self.plan = plan
        self.graph: tf.Graph | None = None
        self.ops: list[tf.Operation] = []

    def __enter__(self):
        if tf.inside_function():  # the graph is readable (eager steps keep the plain path)
            self.graph = tf.compat.v1.get_default_graph()
            self._first = len(self.graph.get_operations())
            self._override = self.graph.gradient_override_map({"MatMul": MATMUL_GRADIENT})
            self._override.__enter__()
        return self

    def __exit__(self, *exc):
        if self.graph is not None:
            self._override.__exit__(*exc)
            self.ops = self.graph.get_operations()[self._first:]
        return False

    def products(self, values: Sequence[tf.Tensor]) -> dict[int, tf.Operation]:
        return find(values, self.plan.candidates, self.ops) if self.ops else {}

    def gradients(self, target: tf.Tensor, values: Sequence[tf.Tensor],
                  products: dict[int, tf.Operation]) -> tuple[list[tf.Tensor | None], Factors]:
        """(d target / d v for the other values, None for the factored ones;
        index -> (x_t, dz_t) for those), by tf.gradients with the products' gradient above."""
        sources = [products[i].outputs[0] if i in products else v for i, v in enumerate(values)]
        _factored_products.update(op.name for op in products.values())
        try:
            grads = tf.gradients(target, sources,
                                 unconnected_gradients=tf.UnconnectedGradients.ZERO)
        finally:
            _factored_products.clear()
        factors = {i: (op.inputs[0], grads[i]) for i, op in products.items()}
        return [None if i in products else g for i, g in enumerate(grads)], factors


class SufficientFactors:
    """Collects every tower's factors of the large dense kernels and multiplies them at home.

    Use, for each tower in order: trace its forward pass in `tower()` and its
    backward pass by that TowerForward's `gradients` (hooks/large_gradients.py), then `add`
    its factors; finally `sums()` for the aggregation (ordered_sum.reduce).
    """

    def __init__(self, aggregation: Aggregation, variables: Sequence[tf.Variable],
                 min_bytes: int):
        self.aggregation = aggregation
        self.variables = list(variables)
        self.candidates = [i for i, v in enumerate(self.variables)
                           if v.shape.rank == 2 and num_bytes(v) >= min_bytes]
        self.received: dict[int, list[tuple[tf.Tensor, tf.Tensor]]] = {}
        self.factored: set[int] | None = None  # what the first tower added factored

    def tower(self) -> TowerForward:
        return TowerForward(self)

    def add(self, factors: Factors, device: str) -> None:
        """Sends one tower's factors (x_t, dz_t), on `device`, to their variables' homes."""
        if self.factored is None:
            self.factored = set(factors)
        elif set(factors) != self.factored:  # the towers run one template: cannot happen
            raise RuntimeError(f"towers factored different variables: {sorted(factors)} "
                               f"against {sorted(self.factored)}")
        for i, (x, dz) in factors.items():
            home = self.aggregation.home_of(self.variables[i])
            self.received.setdefault(i, []).append(
                (self.aggregation.send(x, device, home), self.aggregation.send(dz, device, home)))

    def sums(self) -> dict[int, tf.Tensor]:
        """index -> X^T dZ = sum_t x_t^T dz_t, on the variable's home."""
        out = {}
        for i, pairs in self.received.items():
            with tf.device(self.aggregation.home_of(self.variables[i])):
                x = tf.concat([x for x, _ in pairs], 0)
                dz = tf.concat([dz for _, dz in pairs], 0)
                out[i] = tf.matmul(x, dz, transpose_a=True)
        return out
