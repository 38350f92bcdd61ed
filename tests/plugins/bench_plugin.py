"""`ps_cpu_copy`: the ps_cpu method under another name, registered by a user's module.

The benchmark harnesses' plugin tests load it with `--plugin=tests.plugins.bench_plugin`
and name the method in `--modes` (experiments/bench.py) or `--vary aggregation=...`
(experiments/variants.py). It is ps_cpu itself (exact: the towers' gradients summed
on the host CPU), so it must compute what ps_cpu computes.
"""

from __future__ import annotations

from mgloop import aggregation
from mgloop.aggregation.dense.parameter_server import ParameterServerCpu


@aggregation.register
class ParameterServerCpuCopy(ParameterServerCpu):
    name = "ps_cpu_copy"
