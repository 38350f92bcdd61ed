"""One worker of a job that trains several methods in turn and reports each node's own state.

    python tests/workers/joining_nodes.py --devices=cpu:1 [--KEY=INT ...] ROOT SPEC...

Run by `mgloop.launch.launch(..., command=[python, this file])` (TF_CONFIG set, `--devices`
appended). For each aggregation SPEC (its index i) it runs `prepare.method_config(spec,
ROOT/i, ...)`, resuming what ROOT/i holds: with another worker count than the one that
wrote ROOT/i's checkpoint, and --train_steps at that checkpoint's step, it trains nothing
and the trainer holds exactly what the restore re-dealt to this node
(runs/node_checkpoint.py). Each worker prints, from the real objects the step holds (the
cross-worker stage, the node-level wrapper, the method):

    [joining] state i SPEC | worker=w drift=D memory=M

D = max_v max|copy_0[v] - x[v]| (the DiLoCo family's outer parameters x; -1 without), and
M = sum over this node's error-feedback residuals of |e| (-1 without). A refusal prints
`[joining] refused i SPEC: ...`.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from mgloop.runs import quiet_start  # noqa: E402

quiet_start.load_tensorflow()  # as mgloop.train loads it

from mgloop import ConfigError  # noqa: E402
from mgloop.cluster import workers as cluster  # noqa: E402
from mgloop.runs import experiment, prepare  # noqa: E402


def method_of(aggregation):
    """The method under study inside the run's wrappers (cross-worker stage, node level)."""
    while hasattr(aggregation, "local") or hasattr(aggregation, "inner"):
        aggregation = getattr(aggregation, "local", None) or aggregation.inner
    return aggregation


def node_state(trainer) -> tuple[float, float]:
    """(D, M) of the module docstring, of this worker's node."""
    method = method_of(trainer.aggregation)
    starts = getattr(method, "_start", None)
    drift = -1.0 if starts is None else max(
        float(np.max(np.abs(v.numpy() - x.numpy())))
        for v, x in zip(trainer.copies[0].trainable, starts[0]))
    residuals = getattr(method, "residuals", None)
    memory = -1.0 if residuals is None else sum(
        float(np.sum(np.abs(e.numpy()))) for es in residuals for e in es)
    return drift, memory


def main(argv):
    settings = dict(a[2:].split("=", 1) for a in argv if a.startswith("--"))
    devices = settings.pop("devices")
    overrides = {key: int(value) for key, value in settings.items()}
    root, *specs = [a for a in argv if not a.startswith("--")]
    worker = cluster.from_environment().index
    for index, spec in enumerate(specs):
        config = prepare.method_config(spec, os.path.join(root, str(index)), devices=devices,
                                       **overrides)
        try:
            result = experiment.run(config)
        except ConfigError as error:
            print(f"[joining] refused {index} {spec}: {error}", flush=True)
            continue
        drift, memory = node_state(result.trainer)
        print(f"[joining] state {index} {spec} | worker={worker} drift={drift!r} "
              f"memory={memory!r}", flush=True)


if __name__ == "__main__":
    from mgloop.runs import collector
    collector.for_tracing()  # as mgloop.train's (runs/collector.py)
    main(sys.argv[1:])
