"""Equivalence tolerances from a stated float32 error bound, never fitted to one CPU.

N towers and one device compute the same real-valued training steps; they
differ only in the order of float32 sums (the towers' shards, the aggregation,
and on some CPUs AVX-512 / oneDNN kernels that block their reductions
differently). The bound, per trainable element e, with u = 2^-24 and
gamma(n) = n u / (1 - n u) (Higham, Accuracy and Stability, ch. 3):

1. Gradient. Step t's mean gradient g = (1/B) sum_i g_i (g_i: example i's
   gradient) is formed with at most n rounded additions along any path: the B
   examples (times P positions for a convolution kernel), plus the sums along
   one example's forward and backward path (every layer's fan-in and fan-out)
   and the softmax over K classes. Taking the magnitude of example i's own terms
   as |g_i|, each computation is within gamma(n) * A of the exact value, with
   A = (1/B) sum_i |g_i| (elementwise); so any two orders differ by at most
       dg_t = 2 gamma(n) A_t.
   Where a gradient's terms cancel inside an example, |g_i| is no measure of them: a
   hidden kernel's h (x) delta has delta = mask W^T delta' summed from terms of both
   signs (measured on the mlp: an element of its second kernel 1.6e-10 apart between
   two orders, 2.8x a |g_i|-based bound). For a chain of Dense layers (ReLU, then
   logits under softmax cross-entropy with integer labels: the mlp) A is at least the
   absolute backward pass's (`dense_chain_terms`); a bias in front of a batch norm (0 in exact
   arithmetic) gets its bound from its test (StepBound.term_magnitudes,
   test_batch_norm.py).
2. Update. dg is carried through the optimizer's update map at the one-device
   run's state (Keras's update rules, first order):
     SGD                 dw_t = lr_t dg_t
     momentum mu         dm_t = mu dm_{t-1} + lr_t dg_t,  dw_t = dm_t
     Adam (b1, b2, eps)  w -= a_t m / (sqrt(v) + eps), a_t = lr_t sqrt(1-b2^t) / (1-b1^t):
                         dm_t = (1-b1) sum_r b1^(t-r) dg_r,
                         dsqrt(v)_t = ((1-b2) sum_r b2^(t-r) dg_r^2)^(1/2)  (triangle
                         inequality of the weighted 2-norm), and
                         dw_t = a_t (dm_t + |m_t| dsqrt(v)_t / (sqrt(v_t) + eps))
                                / (max(sqrt(v_t) - dsqrt(v)_t, 0) + eps)
                         (|m/(r+eps) - m'/(r'+eps)| for |m-m'| <= dm, |r-r'| <= dr):
                         where v is tiny, eps caps the division (the AVX-512 failure
                         of issue 12: a few elements whose v is ~0 move by 5e-5 relative).
   Decoupled weight decay multiplies a difference by 1 - lr wd < 1: no term. The
   update itself is formed with at most R = 8 roundings (the learning-rate product,
   Adam's quotient, a sum's scaling by 1/T or lr T) and the assignment
   w <- w - update rounds once: 2 (R |w_t - w_(t-1)| + |w_t|) u per step.
3. Steps. After S steps, |w_towers - w_one| <= tol = FEEDBACK * sum_t (dw_t + the
   roundings of 2.).
   A difference carried into a later step also moves that step's gradient
   (through the Hessian); over the few small steps of these tests (S <= 10,
   gain |H| < 1) that at most doubles the first-order sum: FEEDBACK = 2. The gain is
   what the update makes of a change of the gradient: lr for SGD, lr / (1 - mu) at
   most for momentum, and for Adam a_t (1-b1) / (sqrt(v) + eps), which reaches
   a_t (1-b1) / eps where a gradient is ~0 (a unit barely active). At Keras's
   eps = 1e-7 that is ~1e5 lr and the premise fails: with the mlp on 2 towers, 5 of
   40 random initialisations (AdamW at lr 0.05) and 1 of 20 (Adam at 0.01, 4 towers)
   ended outside the bound, by up to 12x. The tests that hold Adam to one device
   use eps = 1e-3 (0 of 40 and 0 of 20).
   The mean loss of a step differs by at most 2 gamma(n) (1/B) sum_i |loss_i|
   plus sum_e |g_e| tol_e of the weights it is computed at.

A real fault is far outside this bound: a tower's gradient left out or a
missing 1/T changes g by a fraction of |g| itself, where the bound allows
about 1e-4 of A (test_equivalence.py checks that it fails).
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

from mgloop.step import per_tower

U = 2.0 ** -24  # float32 unit roundoff
FEEDBACK = 2.0  # differences carried into later steps (3. above)
UPDATE_ROUNDINGS = 8  # R of 2. above


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def path_sums(model, batch: int) -> int:
    """n of 1. above: B (times the largest P of a convolution, or of an Embedding's lookups
    per example: a row's gradient, and a Dense kernel's on a sequence, sum over every
    position), plus every kernel's fan-in and fan-out (sublayers included, e.g. attention's
    projections), plus 2 L per attention layer of key length L (its softmax and its sum of
    values), plus the K logits of the softmax."""
    n, positions, shape, attention = 0, 1, (0,), 0
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.Embedding):
            positions = max(positions, math.prod(layer.input.shape[1:]))
        attention += isinstance(layer, keras.layers.MultiHeadAttention)
        kernel = getattr(layer, "kernel", None)
        if kernel is None:
            continue
        shape = tuple(kernel.shape)
        n += math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]  # fan-in + fan-out
        if len(shape) > 2 and layer._inbound_nodes:  # a convolution's kernel gradient also
            # sums its output positions (an attention's projections, called inside the layer,
            # have no node of their own: they sum over the Embedding's positions, above)
            positions = max(positions, math.prod(layer.output.shape[1:-1]))
    n += 2 * positions * attention  # self-attention: key length = the sequence's positions
    return batch * positions + n + int(shape[-1])  # the last kernel's outputs: the logits


def _dense_chain(model) -> list | None:
    """The Dense layers of a Sequential of [Flatten,] Dense(relu)..., Dense(linear), else None."""
    if not isinstance(model, keras.Sequential):
        return None
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.Flatten)]
    if not layers or not all(isinstance(layer, keras.layers.Dense) for layer in layers):
        return None
    activations = [layer.activation for layer in layers]
    if (any(a is not keras.activations.relu for a in activations[:-1])
            or activations[-1] is not keras.activations.linear):
        return None
    return layers


def dense_chain_terms(model, x, y) -> dict[int, np.ndarray]:
    """{variable index: (1/B) sum_i |terms| of its gradient} for a chain of Dense layers
    (`_dense_chain`) on softmax cross-entropy with integer labels (else {}): the backward
    pass taken in absolute values, so terms that cancel inside an example count. Per
    example, with h_l the layer inputs and masks the pre-activations' signs (exact):
    t_L = p + onehot(y) (the logits' gradient p - onehot(y), term by term),
    t_l = mask_l (t_(l+1) |W_(l+1)|^T); a kernel's terms |h_l| (x) t_(l+1), a bias's
    t_(l+1). The forward pass's roundings enter through n (path_sums), as for any model.
    Premise: no pre-activation within its rounding of 0 (a flipped ReLU moves a whole
    term)."""
    layers = _dense_chain(model)
    labels = np.asarray(y)
    if layers is None or labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        return {}
    h = np.reshape(np.asarray(x), (len(labels), -1)).astype(np.float64)
    kernels = [layer.kernel.numpy().astype(np.float64) for layer in layers]
    biases = [layer.bias.numpy().astype(np.float64) for layer in layers]
    a, masks = [np.abs(h)], []
    for kernel, bias in zip(kernels[:-1], biases[:-1]):
        z = h @ kernel + bias
        masks.append(z > 0)
        h = np.maximum(z, 0)
        a.append(h)
    logits = h @ kernels[-1] + biases[-1]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    t = [p + np.eye(p.shape[-1])[labels]]
    for layer in range(len(layers) - 2, -1, -1):
        t.insert(0, masks[layer] * (t[0] @ np.abs(kernels[layer + 1]).T))
    batch = len(labels)
    terms = {}
    for layer_index, layer in enumerate(layers):
        kernel_index = next(i for i, v in enumerate(model.trainable_variables)
                            if v is layer.kernel)
        terms[kernel_index] = a[layer_index].T @ t[layer_index] / batch
        terms[kernel_index + 1] = t[layer_index].sum(0) / batch
    return terms


class StepBound:
    """Accumulates tol (3. above) while the one-device reference trains: the reference calls
    `before(model, optimizer, loss_fn, x, y)` before each step and `after()` after it."""

    def __init__(self):
        self.dw = None  # sum over steps of dw_t + 2 u |w_t|, per variable
        self.loss_sum = 0.0  # bound on the difference of the sums of step losses
        self._step = None  # (model, optimizer, lr_t, dg_t) of the step under way
        self._state = None  # momentum: dm; Adam: (sum b1^(t-r) dg_r, sum b2^(t-r) dg_r^2)
        self._per_example = None

    def before(self, model, optimizer, loss_fn, x, y, micro_batches: int = 1) -> None:
        """`micro_batches` k > 1: the step's gradient is the mean of the gradients of k
        equal micro-batches of (x, y) (accumulation), each its own forward pass (a batch
        norm normalises each apart); A is their mean, and n counts all B rows (the B/k
        rows of a micro-batch, the k-term sum and more)."""
        variables = model.trainable_variables
        if self._per_example is None:  # traced once per reference run
            def gradient_and_magnitude(x, y):  # g and A of 1. above, per variable
                # stateless: the reference's moving statistics and random state stay as they are
                trainable = [tf.identity(v) for v in model.trainable_variables]
                state = [tf.identity(v) for v in model.non_trainable_variables]
                with tf.GradientTape() as tape:
                    tape.watch(trainable)
                    outputs, _ = model.stateless_call(trainable, state, x,
                                                      **per_tower.call_kwargs(model, True))
                    losses = loss_fn(y, outputs)
                    if losses.shape.rank > 1:  # per token: example i's loss is its tokens' mean
                        losses = tf.reduce_mean(losses, axis=list(range(1, losses.shape.rank)))
                per_example = tape.jacobian(losses, trainable)  # [B, *shape] each
                return (losses, [tf.reduce_mean(j, 0) for j in per_example],
                        [tf.reduce_mean(tf.abs(j), 0) for j in per_example])
            self._per_example = tf.function(gradient_and_magnitude)
        parts = []
        for xk, yk in zip(tf.split(x, micro_batches), tf.split(y, micro_batches)):
            losses, g, a = self._per_example(xk, yk)
            a = [v.numpy().astype(np.float64) for v in a]
            for index, floor in self.term_magnitudes(model, xk, yk).items():
                a[index] = np.maximum(a[index], floor)
            parts.append((losses.numpy(), [v.numpy() for v in g], a))
        losses = np.concatenate([p[0] for p in parts])
        g = [np.mean(v, 0) for v in zip(*[p[1] for p in parts])]
        a = [np.mean(v, 0) for v in zip(*[p[2] for p in parts])]
        two_gamma = 2 * gamma(path_sums(model, len(losses)))
        dg = [two_gamma * x for x in a]
        loss_bound = two_gamma * float(np.mean(np.abs(losses)))
        if self.dw is not None:  # computed at weights that differ by up to tol already
            loss_bound += sum(float(np.sum(np.abs(gv) * FEEDBACK * d))
                              for gv, d in zip(g, self.dw))
        self.loss_sum += loss_bound
        self.last = (dg, loss_bound)  # this step's bounds on the gradient and the mean loss
        if optimizer is not None:
            self._step = (model, optimizer, float(optimizer.learning_rate), dg,
                          [v.numpy() for v in variables])

    def term_magnitudes(self, model, x, y) -> dict[int, np.ndarray]:
        """Variable index -> a bound on (1/B) sum |terms| of its gradient where the
        example's own |g_i| is not one (1. above): a chain of Dense layers'
        (`dense_chain_terms`), else none; a test overrides it for what it knows (e.g. a
        bias in front of a batch norm: 0 in exact arithmetic)."""
        return dense_chain_terms(model, x, y)

    def after(self) -> None:
        model, optimizer, lr, dg, before = self._step
        variables = model.trainable_variables
        if self.dw is None:
            self.dw = [np.zeros(v.shape, np.float64) for v in variables]
        if isinstance(optimizer, keras.optimizers.Adam):
            dw = self._adam(optimizer, variables, lr, dg)
        else:
            mu = float(optimizer.momentum)
            if self._state is None:
                self._state = [np.zeros_like(d) for d in dg]
            self._state = [mu * dm + lr * d for dm, d in zip(self._state, dg)]
            dw = self._state
        for total, d, v, w in zip(self.dw, dw, variables, before):
            after = v.numpy().astype(np.float64)
            total += d + 2 * U * (UPDATE_ROUNDINGS * np.abs(after - w) + np.abs(after))

    def _adam(self, optimizer, variables, lr, dg) -> list[np.ndarray]:
        t = int(optimizer.iterations.numpy())  # this step's t (iterations after the update)
        b1, b2, eps = optimizer.beta_1, optimizer.beta_2, optimizer.epsilon
        if self._state is None:
            self._state = ([np.zeros_like(d) for d in dg], [np.zeros_like(d) for d in dg])
        sum1 = [b1 * s + d for s, d in zip(self._state[0], dg)]
        sum2 = [b2 * s + d * d for s, d in zip(self._state[1], dg)]
        self._state = (sum1, sum2)
        alpha = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        out = []
        for v, s1, s2 in zip(variables, sum1, sum2):
            index = optimizer._get_variable_index(v)
            m = np.abs(optimizer._momentums[index].numpy().astype(np.float64))
            root = np.sqrt(optimizer._velocities[index].numpy().astype(np.float64))
            dm, droot = (1 - b1) * s1, np.sqrt((1 - b2) * s2)
            # |m/(r+eps) - m'/(r'+eps)| <= (dm + |m| dr / (r+eps)) / (max(r-dr, 0) + eps)
            out.append(alpha * (dm + m * droot / (root + eps))
                       / (np.maximum(root - droot, 0.0) + eps))
        return out

    def weights(self) -> list[np.ndarray]:
        """tol per variable: the bound on |w_towers - w_one_device| after the steps so far."""
        return [FEEDBACK * d for d in self.dw]


_GRADIENT_BOUNDS: dict[tuple[int, int], tuple] = {}  # (model, loss_fn, StepBound)


def gradient_bound(model, loss_fn, x, y) -> tuple[np.ndarray, float]:
    """For one batch at the model's weights: dg of 1. above (every variable, flattened and
    concatenated) and the bound on its mean loss; any two summation orders are within them."""
    cached = _GRADIENT_BOUNDS.get((id(model), id(loss_fn)))
    if cached is None or cached[0] is not model or cached[1] is not loss_fn:
        cached = _GRADIENT_BOUNDS[(id(model), id(loss_fn))] = (model, loss_fn, StepBound())
    bound = cached[2]  # one trace per model and loss
    bound.before(model, None, loss_fn, tf.constant(x), tf.constant(y))
    dg, loss_bound = bound.last
    return np.concatenate([d.ravel() for d in dg]), loss_bound


def sum_bound(values: list[np.ndarray], average: bool = False) -> np.ndarray:
    """Two float32 sums of the same T arrays in any order differ by at most
    2 gamma(T) sum_t |v_t| (elementwise); a mean adds the division's rounding, u |mean|."""
    magnitude = np.sum(np.abs(np.asarray(values, np.float64)), axis=0)
    bound = 2 * gamma(len(values)) * magnitude
    if average:
        bound = bound / len(values) + U * magnitude / len(values)
    return bound


def logit_bound(model, x: np.ndarray) -> np.ndarray:
    """Two evaluations of a Sequential model of Conv2D / Dense (ReLU or linear),
    MaxPooling2D, GlobalAveragePooling2D and Flatten on the same examples, in any
    summation order, give logits within 2 gamma(n) a_L, where a is the absolute forward
    pass a_0 = |x|, a_(l+1) = |W_l| * a_l + |b_l| (* a dense or convolution product; a
    ReLU or a max pool is 1-Lipschitz in the largest error and only shrinks magnitudes;
    a global average pool over P positions is the mean of a, P + 1 roundings), and
    n = the sum of the fan-ins (+1 for each bias; a convolution's fan-in is kh kw c_in)
    and of the pools' P + 1: Higham's bound for a chain of dot products (gamma(i) +
    gamma(j) + gamma(i) gamma(j) <= gamma(i + j) composes the layers)."""
    a = np.abs(np.asarray(x, np.float64))
    n = 0
    for layer in model.layers:
        if isinstance(layer, keras.layers.Flatten):
            a = np.reshape(a, (len(a), -1))
            continue
        if isinstance(layer, keras.layers.MaxPooling2D):
            a = tf.nn.max_pool2d(a, layer.pool_size, layer.strides, layer.padding.upper()).numpy()
            continue
        if isinstance(layer, keras.layers.GlobalAveragePooling2D):
            n += a.shape[1] * a.shape[2] + 1
            a = a.mean(axis=(1, 2))
            continue
        assert isinstance(layer, (keras.layers.Dense, keras.layers.Conv2D)), (
            f"logit_bound: {layer.name} is not Dense, Conv2D or a pool")
        assert layer.activation in (keras.activations.relu, keras.activations.linear), (
            f"logit_bound: {layer.name}'s activation is not ReLU or linear")
        kernel, bias = (np.abs(v.numpy().astype(np.float64)) for v in layer.weights)
        if isinstance(layer, keras.layers.Conv2D):
            a = tf.nn.conv2d(a, kernel, layer.strides, layer.padding.upper(),
                             dilations=layer.dilation_rate).numpy() + bias
        else:
            a = np.reshape(a, (len(a), -1)) @ kernel + bias
        n += int(np.prod(kernel.shape[:-1])) + 1
    return 2 * gamma(n) * a


def mean_loss_bound(model, x: np.ndarray, losses: np.ndarray) -> float:
    """Cross-entropy of logits, loss_i = logsumexp(z_i) - z_iy, moves by at most
    2 max_c |dz_ic| (each term is 1-Lipschitz in the largest change of a logit); the
    mean of the B losses adds 2 gamma(B) mean |loss_i|."""
    per_example = 2 * logit_bound(model, x).max(axis=-1)
    return float(per_example.mean() + 2 * gamma(len(losses)) * np.abs(losses).mean())


class MovingMomentsBound:
    """Batch-norm moving statistics of h = flatten(x) W + b (a Dense in front of the norm),
    computed in float32 per group of examples (a tower's shard), against the exact values.

    Per element, with K the fan-in and A = |x| |W| + |b|: |dh| <= e_h = gamma(K+1) A.
    (Each rounding below is relative to the float32 run's value, bounded by the exact
    one's magnitude plus its bound so far.)
    A group of n rows: mean m = (1/n) sum h, |dm| <= e_m = mean(e_h) + gamma(n+1) mean|h|;
    variance by either formula Keras or mgloop uses (E[h^2] - m^2, or E[(h - m)^2]):
        |dv| <= mean(2 (|h| + |m|) (e_h + e_m) + (e_h + e_m)^2) + gamma(n+3) (mean h^2 + m^2).
    The T groups' statistics averaged (a float32 sum in any order, then 1/T):
        e_avg = mean_t(e_t) + gamma(T+1) mean_t|s_t|;
    the moving update s' = mu s + (1 - mu) avg (two products and a sum):
        E' = mu E + (1 - mu) e_avg + gamma(3) (mu |s| + (1 - mu) |avg|).
    `update` returns the exact (float64) moving statistics and carries their bound.

    `weight_bound` (dW, db), elementwise bounds on how far the weights the float32 run
    used lie from `kernel`, `bias`: h moves by at most |x| dW + db more, which enters
    exactly as e_h does (the mean and variance bounds above hold for any perturbation
    of h within e_h): e_h = gamma(K+1) (A + |x| dW + db) + |x| dW, and the mean's bound
    gains db; db moves every row of a feature by the same amount, which leaves the
    variance as it is (only its roundings grow with |h| + db). The bound is on
    |float32 statistics at the moved weights - exact statistics at W|."""

    def __init__(self, momentum: float, features: int):
        self.momentum = momentum
        self.mean, self.variance = np.zeros(features), np.ones(features)
        self.mean_bound, self.variance_bound = np.zeros(features), np.zeros(features)

    def update(self, x: np.ndarray, kernel: np.ndarray | None, bias: np.ndarray | None,
               groups: int, weight_bound: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        """kernel and bias None: the norm is on flatten(x) itself (h = x, e_h = 0)."""
        x = np.reshape(x, (len(x), -1)).astype(np.float64)
        identity = kernel is None
        if identity:
            kernel, bias = np.eye(x.shape[1]), np.zeros(x.shape[1])
        kernel, bias = kernel.astype(np.float64), bias.astype(np.float64)
        magnitudes = np.abs(x) @ np.abs(kernel) + np.abs(bias)
        turned, shift = 0.0, 0.0  # |x| dW and db
        if weight_bound is not None:
            turned, shift = np.abs(x) @ weight_bound[0], weight_bound[1]
        fan_in = 0 if identity else kernel.shape[0] + 1  # h = x: no rounding
        e_h = gamma(fan_in) * (magnitudes + turned + shift) + turned
        stats = []
        for h, e in zip(np.split(x @ kernel + bias, groups), np.split(e_h, groups)):
            n, m = len(h), h.mean(0)
            # roundings are relative to the float32 run's values: |h| + e_h + db, |m| + e_m
            e_m = e.mean(0) + gamma(n + 1) * (np.abs(h) + e + shift).mean(0)
            spread = e + e_m  # db shifts every row and the mean alike: not in the variance
            e_v = ((2 * (np.abs(h) + np.abs(m)) * spread + spread ** 2).mean(0)
                   + gamma(n + 3) * (((np.abs(h) + e + shift) ** 2).mean(0)
                                     + (np.abs(m) + e_m + shift) ** 2))
            stats.append((m, h.var(0), e_m + shift, e_v))
        mu = self.momentum
        for name, index in (("mean", 0), ("variance", 1)):
            values = np.array([s[index] for s in stats])
            average = values.mean(0)
            errors = np.array([s[index + 2] for s in stats])
            e_avg = errors.mean(0) + gamma(groups + 1) * (np.abs(values) + errors).mean(0)
            previous, previous_bound = getattr(self, name), getattr(self, f"{name}_bound")
            bound = (mu * previous_bound + (1 - mu) * e_avg
                     + gamma(3) * (mu * (np.abs(previous) + previous_bound)
                                   + (1 - mu) * (np.abs(average) + e_avg)))
            setattr(self, name, mu * previous + (1 - mu) * average)
            setattr(self, f"{name}_bound", bound)


TRANSPORT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}  # 11 and 8 significant bits


def transport_bound(dtype: str, hops: int) -> float:
    """Bound on ||w_compressed - w_one|| / ||w_one - w_start|| (2-norms over every weight) when
    each gradient value is rounded to `dtype` at most once per hop, `hops` hops: each step's
    update is within (1 + u_dtype)^hops - 1 of the exact one, relatively, elementwise and so
    in norm; the float32 part (above) is four orders smaller; FEEDBACK over the steps."""
    return FEEDBACK * ((1 + TRANSPORT_ROUNDOFF[dtype]) ** hops - 1)


def assert_within(actual: list[np.ndarray], expected: list[np.ndarray],
                  tolerance: list[np.ndarray]) -> None:
    """|actual - expected| <= tolerance elementwise, per variable, with the worst element named."""
    assert len(actual) == len(expected) == len(tolerance)
    for index, (a, e, t) in enumerate(zip(actual, expected, tolerance)):
        excess = np.abs(np.asarray(a, np.float64) - e) - t
        worst = np.unravel_index(np.argmax(excess), excess.shape) if excess.size else ()
        assert excess.size == 0 or excess[worst] <= 0, (
            f"variable {index} {np.shape(e)}: element {worst} differs by "
            f"{abs(a[worst] - e[worst]):.3g} > bound {t[worst]:.3g}")


def assert_matches_reference(weights: list[np.ndarray], loss_sum: float | None,
                             reference_run) -> None:
    """Weights (and, unless None, the loss sum) within the bound of the reference run
    (weights, loss sum, StepBound), as from helpers.train_reference_bounded."""
    expected_weights, expected_loss_sum, bound = reference_run
    assert_within(weights, expected_weights, bound.weights())
    if loss_sum is not None:
        assert abs(loss_sum - expected_loss_sum) <= bound.loss_sum, (
            f"loss sum {loss_sum} differs from {expected_loss_sum} by more than "
            f"{bound.loss_sum:.3g}")


ELEMENTARY_ULPS = 4  # exp, log, log1p, sqrt of TF's CPU kernels (Eigen's vectorised
# approximations, oneDNN's): within ELEMENTARY_ULPS units of u of the exact value


def sigmoid_cross_entropy_bound(z: np.ndarray) -> np.ndarray:
    """tf.nn.sigmoid_cross_entropy_with_logits, max(z, 0) - z y + log1p(exp(-|z|)), y in
    {0, 1}, against the exact value: exp and log1p each within ELEMENTARY_ULPS u relative
    (log1p(e) moves by at most its input's relative error, as e / ((1 + e) log1p(e)) <= 1),
    z y exact, two additions: within gamma(2 + 2 ELEMENTARY_ULPS) of the terms' magnitudes."""
    z = np.abs(np.asarray(z, np.float64))
    return gamma(2 + 2 * ELEMENTARY_ULPS) * (2 * z + np.log1p(np.exp(-z)))


def softmax_cross_entropy_bound(z: np.ndarray) -> np.ndarray:
    """tf.nn.(sparse_)softmax_cross_entropy_with_logits per row, log(sum_k exp(z_k - max))
    - (z_y - max), against the exact value: z - max rounds once (u R, R = max - min of the
    row), exp within ELEMENTARY_ULPS u, the K-term sum gamma(K), so log's argument S >= 1
    is within gamma(K + ELEMENTARY_ULPS) + u R relative, which log turns into that much
    absolute error, plus its own ELEMENTARY_ULPS u log S; the subtraction rounds once.
    Within gamma(K + 2 ELEMENTARY_ULPS + 2) (1 + 2 R + log S) per row."""
    z = np.asarray(z, np.float64)
    shifted = z - z.max(-1, keepdims=True)
    spread = -shifted.min(-1)
    log_sum = np.log(np.exp(shifted).sum(-1))
    return gamma(z.shape[-1] + 2 * ELEMENTARY_ULPS + 2) * (1 + 2 * spread + log_sum)
