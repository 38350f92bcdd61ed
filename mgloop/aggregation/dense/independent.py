"""`independent`: replicated variables and no gradient exchange at all.

Replica t applies g[t] alone, its own shard's gradient, and keeps its own
non-trainable state: T models trained side by side on different data. It is
the no-communication upper bound on speed, and a sanity check that replicas
do diverge when nothing keeps them equal. It is not mean semantics: it is the
one mode that does not equal the single-device run (tested to differ).

It produces no one model: what is evaluated, exported and returned (`global_model`) is copy
0, tower 0's model with its own non-trainable state, and summary.json says so.
"""

from __future__ import annotations

from mgloop.aggregation import register
from mgloop.aggregation.base import REPLICATED, Aggregation
from mgloop.aggregation.capabilities import Capabilities


@register
class Independent(Aggregation):
    name = "independent"
    capabilities = Capabilities(
        layout=REPLICATED, exchanges=False,
        exact=False,  # not a mean: replica t trains on shard t alone (no error bound)
        across_workers=False,  # nothing to sum between workers
        averages_non_trainable=False)

    def parameter_devices(self):
        return list(self.devices.towers)

    def reduce(self, tower_values, variables, average=True):
        return [list(values) for values in tower_values]

    def global_model_name(self) -> str:
        return "copy 0 (tower 0's model: independent trains one model per tower)"
