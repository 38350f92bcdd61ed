"""The MirroredStrategy baselines' old loss, put back in a benchmark's workers.

`tf.nn.compute_average_loss` of the loss's values per token ([B, L]) sums the L tokens of
every example and divides by the global batch: L times the mean loss mgloop takes. The
baselines now give it one value per example (third_party.mirrored_strategy.per_example);
this module, loaded with `--plugin=tests.plugins.token_sum_mirrored`, makes that the
identity again, so that tests/test_bench.py can see experiments/bench.py refuse the result.
"""

from __future__ import annotations

from third_party import mirrored_strategy


def _every_value(losses):
    return losses


mirrored_strategy.per_example = _every_value  # both baselines read it at each call
