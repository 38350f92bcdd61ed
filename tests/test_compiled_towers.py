"""--xla_towers: each tower's forward, loss and backward as one XLA-compiled function
(mgloop/step/compiled_towers.py) trains what one device trains on the global batch, within
tests/tolerance.py's bound (XLA may fuse and reorder float32 sums: rounding only, the bound
test_equivalence.py uses); what needs the tower's index inside its pass is refused in one
line before anything is built. Whether it is faster is benchmarked, not tested
(experiments/bench.py: `MODE+xla`; on these CPUs it is slower, docs/results).
"""

import pytest

from mgloop.runs.config import Config
from mgloop.errors import ConfigError
from tests import helpers
from tests import tolerance

STEPS = 3


@pytest.mark.parametrize("mode", ["ps_cpu", "ring"])
def test_compiled_towers_equal_one_device(mode, logdir):
    config = helpers.small_config(logdir, devices="cpu:2", aggregation=mode, xla_towers=True)
    trainer, _ = helpers.train_mgloop(config, helpers.batches(STEPS))
    assert trainer.step.group_pass.__class__.__name__ == "CompiledPass"
    reference = helpers.train_reference_bounded(config, helpers.batches(STEPS))
    for weights in helpers.copy_weights(trainer):
        tolerance.assert_matches_reference(weights, None, reference)


@pytest.mark.parametrize("settings,named", [
    (dict(byzantine_towers=1, attack="labelflip"), "--attack=labelflip"),
    (dict(batch_norm="sync"), "--batch_norm=sync"),
    (dict(mixed_precision="mixed_float16"), "--mixed_precision=mixed_float16"),
    (dict(towers_per_device=2), "--towers_per_device=2"),
    (dict(aggregation="colocate"), "--aggregation=colocate"),
])
def test_what_reads_the_tower_inside_its_pass_is_refused(settings, named, logdir):
    config = Config(devices="cpu:2", xla_towers=True, logdir=str(logdir), **settings)
    with pytest.raises(ConfigError) as error:
        config.validated()
    message = str(error.value)
    assert message.startswith("--xla_towers: ") and named in message
    assert message.endswith("use --noxla_towers") and "\n" not in message
