"""--sufficient_factor_bytes: dense kernels' gradients as one product of the towers' factors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from mgloop.step import sufficient_factors
from mgloop.aggregation.base import canonical
from mgloop.step.hooks.large_gradients import SufficientFactorsHook
from mgloop.step.hooks.sampled_stats import GradientStats
from tests import helpers
from tests import tolerance
from tests.test_ordered_sum import WIDE, step_peak_bytes, wide_model

STEPS = 5
TOWERS = 4


def kernel_indices(trainer) -> list[int]:
    return [i for i, v in enumerate(trainer.copies[0].trainable) if v.shape.rank == 2]


def sent_by_tower(trainer, tower: int) -> int:
    """Bytes tower `tower`'s device sent in one traced step."""
    return trainer.aggregation.traffic.sent.get(canonical(trainer.tower_devices[tower]), 0)


@pytest.mark.parametrize("mode", ["ps_cpu", "ps_spread"])  # one home; a home per variable
def test_factored_kernels_train_like_a_single_device(mode, logdir):
    """Threshold 1 byte: every kernel of the MLP takes the factored path on 4 towers; the
    weights and losses are those of one device on the whole batch."""
    config = helpers.small_config(logdir, devices=f"cpu:{TOWERS}", aggregation=mode,
                                  sufficient_factor_bytes=1, ordered_sum_bytes=0)
    trainer, loss_sum = helpers.train_mgloop(config, helpers.batches(STEPS))
    assert trainer.large_gradients == {"factored": kernel_indices(trainer), "ordered": []}
    expected = helpers.train_reference_bounded(config, helpers.batches(STEPS))
    tolerance.assert_matches_reference(helpers.copy_weights(trainer)[0], loss_sum, expected)


def test_a_tower_sends_its_factors_instead_of_its_kernel_gradients(logdir):
    """ps_cpu: the last tower sends, per step, b (m + n) elements per kernel (x_t and dz_t)
    instead of m n, and every bias gradient as before (its reads come from the home)."""
    per_tower = helpers.GLOBAL_BATCH // TOWERS
    sent = {}
    for threshold in (0, 1):
        config = helpers.small_config(logdir, devices=f"cpu:{TOWERS}", aggregation="ps_cpu",
                                      sufficient_factor_bytes=threshold, ordered_sum_bytes=0)
        trainer, _ = helpers.train_mgloop(config, helpers.batches(1))
        sent[threshold] = sent_by_tower(trainer, TOWERS - 1)
    variables = trainer.copies[0].trainable
    kernels = [variables[i] for i in kernel_indices(trainer)]
    full = sum(k.shape.num_elements() for k in kernels) * 4
    factors = sum(per_tower * (k.shape[0] + k.shape[1]) for k in kernels) * 4
    assert sent[0] - sent[1] == full - factors
    assert factors < full


def regularized_model():
    """A kernel with an L2 penalty: its value has a second consumer (the penalty), so its
    gradient is not the matmul's alone and it must not be factored."""
    return keras.Sequential([keras.Input(helpers.DATASET.input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(32, activation="relu",
                                                kernel_regularizer=keras.regularizers.L2(0.1)),
                             keras.layers.Dense(helpers.DATASET.num_classes)])


@pytest.mark.parametrize("ordered_sum_bytes", [0, 1])
def test_a_kernel_with_a_second_use_keeps_its_own_gradient(ordered_sum_bytes, logdir):
    """Only the unregularized kernel is factored: the traffic saved is that kernel's, and
    the weights match the single-device reference (which fails if the penalty's gradient
    were dropped). With the ordered sum on too, it takes every variable not factored."""
    per_tower = helpers.GLOBAL_BATCH // TOWERS
    sent, trainers = {}, {}
    for threshold in (0, 1):
        config = helpers.small_config(logdir, devices=f"cpu:{TOWERS}", aggregation="ps_cpu",
                                      sufficient_factor_bytes=threshold,
                                      ordered_sum_bytes=ordered_sum_bytes)
        trainers[threshold] = helpers.build_trainer(config, make_model=regularized_model)
        helpers.run_batches(trainers[threshold], helpers.batches(STEPS))
        sent[threshold] = sent_by_tower(trainers[threshold], TOWERS - 1)
    # variables: regularized kernel, its bias, output kernel, its bias
    assert trainers[1].large_gradients == {
        "factored": [2], "ordered": [0, 1, 3] if ordered_sum_bytes else []}
    last = trainers[1].copies[0].trainable[2]
    m, n = last.shape
    assert sent[0] - sent[1] == (m * n - per_tower * (m + n)) * 4
    expected = helpers.train_reference_bounded(config, helpers.batches(STEPS),
                                               make_model=regularized_model)
    tolerance.assert_matches_reference(helpers.copy_weights(trainers[1])[0], None, expected)


def test_factored_kernel_allocates_one_gradient_instead_of_one_per_tower(logdir):
    """4 towers, the ordered sum off in both: the plain sum needs the 4 towers' 6 MiB
    gradients of the wide kernel at once; the factored one only its product at home
    (the towers' own x_t^T dz_t are pruned from the step). Three kernels lower in
    principle; asserted at least one kernel lower, as in test_ordered_sum.py, because the
    allocator's peak counts whole chunks (a free chunk of up to twice the request) and that
    slack depends on what earlier tests in the process left: after other tests the full
    suite once measured 1.84 kernels. Without factoring the two peaks are equal. Same
    weights."""
    batches = helpers.batches(2)
    trainers = {}
    for threshold in (0, 2 ** 20):
        config = helpers.small_config(logdir, devices=f"cpu:{TOWERS}", aggregation="ps_cpu",
                                      sufficient_factor_bytes=threshold, ordered_sum_bytes=0)
        trainers[threshold] = helpers.build_trainer(config, make_model=wide_model)
        helpers.run_batches(trainers[threshold], batches[:1])  # trace, build the slots
    assert trainers[0].large_gradients["factored"] == []
    assert trainers[2 ** 20].large_gradients["factored"] == [0]  # the wide kernel alone
    kernel = trainers[0].copies[0].trainable[0]
    assert kernel.shape[1] == WIDE
    kernel_bytes = kernel.shape.num_elements() * 4
    peaks = {threshold: step_peak_bytes(trainer, batches[1])
             for threshold, trainer in trainers.items()}
    assert peaks[0] - peaks[2 ** 20] >= kernel_bytes, peaks
    # both are within the bound of the one-device run (tests/tolerance.py), so within twice it
    _, _, bound = helpers.train_reference_bounded(config, batches, make_model=wide_model)
    plain, factored = (helpers.copy_weights(t)[0] for t in trainers.values())
    tolerance.assert_within(factored, plain, [2 * t for t in bound.weights()])


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
def test_the_towers_matmul_gradient_is_tensorflows(transpose_a, transpose_b):
    """Every MatMul of a factoring tower's forward pass takes mgloop's gradient: for an
    unfactored product, TensorFlow's (the tape's) in each transpose case; for a factored
    one, the same dx by (W dz^T)^T and no dW."""
    rng = np.random.default_rng(0)
    a = tf.constant(rng.normal(size=(5, 3) if transpose_a else (3, 5)), tf.float32)
    b = tf.constant(rng.normal(size=(4, 5) if transpose_b else (5, 4)), tf.float32)
    weights = tf.constant(rng.normal(size=(3, 4)), tf.float32)

    def loss_of(a, b):
        return tf.reduce_sum(tf.tanh(tf.matmul(a, b, transpose_a=transpose_a,
                                               transpose_b=transpose_b)) * weights)

    with tf.GradientTape() as tape:
        tape.watch([a, b])
        loss = loss_of(a, b)
    expected = tape.gradient(loss, [a, b])

    @tf.function
    def overridden(a, b, factored: bool):
        graph = tf.compat.v1.get_default_graph()
        with graph.gradient_override_map({"MatMul": sufficient_factors.MATMUL_GRADIENT}):
            loss = loss_of(a, b)
        product, = [op for op in graph.get_operations() if op.type == "MatMul"]
        if factored:
            sufficient_factors._factored_products.add(product.name)
        try:
            return tf.gradients(loss, [a, b])
        finally:
            sufficient_factors._factored_products.clear()

    # Bound (tests/tolerance.py): z = op(a) op(b) sums k = 5 products, so two orders differ
    # by dz <= 2 gamma(5) |op(a)| |op(b)|; the upstream gradient u = (1 - tanh^2 z) weights
    # by 0.77 dz |weights| (|d/dz (1 - tanh^2 z)| <= 0.77) plus 3 roundings; the gradients
    # u op(b)^T and op(a)^T u (3 and 4 products) by 2 gamma(5) |u| |op(b)|^T etc. + du |op(b)|^T.
    op_a = np.abs(a.numpy().T if transpose_a else a.numpy()).astype(np.float64)
    op_b = np.abs(b.numpy().T if transpose_b else b.numpy()).astype(np.float64)
    upstream = np.abs(weights.numpy()).astype(np.float64)  # >= |u|
    du = 0.77 * 2 * tolerance.gamma(5) * (op_a @ op_b) * upstream + 6 * tolerance.U * upstream
    bound_a = 2 * tolerance.gamma(5) * upstream @ op_b.T + du @ op_b.T
    bound_b = op_a.T @ (2 * tolerance.gamma(5) * upstream) + op_a.T @ du
    bounds = [bound_a.T if transpose_a else bound_a, bound_b.T if transpose_b else bound_b]
    tolerance.assert_within([g.numpy() for g in overridden(a, b, False)],
                            [e.numpy() for e in expected], bounds)
    if not transpose_a and not transpose_b:  # the factored product's form: z = x W
        dx, dw = overridden(a, b, True)
        tolerance.assert_within([dx.numpy()], [expected[0].numpy()], bounds[:1])
        assert dw is None


def test_diagnostics_keep_factoring_on_the_sampled_step(logdir):
    """--diagnostics (on by default): the sampled step factors as the others do (no tower
    holds its whole gradient of a factored kernel, so the statistics leave those kernels
    out); training still matches the single device."""
    config = helpers.small_config(logdir, devices=f"cpu:{TOWERS}", aggregation="ps_cpu",
                                  sufficient_factor_bytes=1, ordered_sum_bytes=0,
                                  diagnostics=True, summary_every=STEPS)
    trainer = helpers.build_trainer(config)
    factors = trainer.step.hooks.find(SufficientFactorsHook)
    assert trainer.loop.sampled_step.hooks.find(SufficientFactorsHook) is factors
    stats_hook = trainer.loop.sampled_step.hooks.find(GradientStats)
    assert factors.candidates and stats_hook.leave_out == set(factors.candidates)
    steps_batches = helpers.batches(STEPS)
    stream = tf.data.Dataset.from_tensor_slices((np.stack([x for x, _ in steps_batches]),
                                                 np.stack([y for _, y in steps_batches])))
    result = trainer.train_loop(iter(stream), STEPS)  # its last step is the sampled one
    assert result.steps == STEPS and result.stats["tower_0/grad_norm"] > 0
    assert np.isfinite(list(result.stats.values())).all()
    assert trainer.large_gradients["factored"]
    loss_sum = result.loss_sum
    expected = helpers.train_reference_bounded(config, helpers.batches(STEPS))
    tolerance.assert_matches_reference(helpers.copy_weights(trainer)[0], loss_sum, expected)
