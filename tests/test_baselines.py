"""The benchmark's baselines compute what mgloop computes: same initial weights, same batch,
one step, the same mean loss over the global batch and the same updated weights.

Tolerance: each system lies within the float32 bound (tests/tolerance.py) of the
one-device run of that step from the seed's weights, so any two within twice it."""

import numpy as np
import pytest

from experiments import bench_systems
from tests import helpers
from tests import tolerance



def built(system, model, towers, dataset="synthetic", global_batch=16):
    spec = bench_systems.Spec(system=system, model=model, dataset=dataset, towers=towers,
                              global_batch=global_batch, steps=1, seed=5, learning_rate=0.1)
    return bench_systems.build(spec)


def weights(system):
    return [np.asarray(w) for w in system.model.get_weights()]


def step_loss(system):
    """The one step's loss: the compiled loops return the sum over steps, fit logs the mean."""
    return system.last_loss_sum if hasattr(system, "last_loss_sum") else system.last_logs["loss"]


@pytest.mark.parametrize("model,towers", [("mlp", 4), ("cnn", 2)])
def test_baselines_equal_mgloop_on_one_step(model, towers, logdir):
    own = dict(mlp_depth=2) if model == "mlp" else {}  # the benchmark's: the builder's default
    bound = helpers.bound_of_run(helpers.small_config(
        logdir, model=model, global_batch_size=16, seed=5, learning_rate=0.1,
        optimizer="momentum", train_steps=1, deterministic=False, **own), 1)
    weights_bound = [2 * t for t in bound.weights()]
    reference = built("mgloop:ps_cpu", model, towers)
    initial = weights(reference)
    reference.run()
    expected_loss, expected_weights = step_loss(reference), weights(reference)
    assert any(np.abs(a - b).max() > 1e-4 for a, b in zip(expected_weights, initial))
    for name in bench_systems.BASELINES:
        system = built(name, model, 1 if name == "single_device" else towers)
        try:
            for a, b in zip(weights(system), initial):  # the seed's initial weights
                np.testing.assert_array_equal(a, b)
            system.run()
            assert abs(step_loss(system) - expected_loss) <= 2 * bound.loss_sum, name
            tolerance.assert_within(weights(system), expected_weights, weights_bound)
        finally:
            system.close()


def test_mirrored_replicas_stay_identical():
    system = built("mirrored_ctl", "mlp", 4)
    system.run()
    for variable in system.model.trainable_variables:
        copies = [np.asarray(v) for v in variable.value.values]
        assert len(copies) == 4
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])
