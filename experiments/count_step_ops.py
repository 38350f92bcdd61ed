"""Ops in the traced compiled loop (every function of its graph), a deterministic check that
a refactor of the step adds no per-step work. Run it on two checkouts and compare:

    PYTHONPATH=. python experiments/count_step_ops.py ring cpu:4 [setting=value ...]
"""

import sys

from tests import helpers


def main(argv):
    mode, devices = argv[1], argv[2]
    extra = {k: (int(v) if v.isdigit() else v) for k, v in (a.split("=") for a in argv[3:])}
    config = helpers.small_config(f"/tmp/count_step_ops_{mode}", devices=devices,
                                  aggregation=mode, **extra)
    trainer = helpers.build_trainer(config)
    helpers.run_batches(trainer, helpers.batches(2))
    loop = getattr(trainer, "loop", trainer).compiled_loop  # before issue 14: the Trainer's
    total = 0
    for function in loop._list_all_concrete_functions():
        graph = function.graph.as_graph_def()
        total += len(graph.node) + sum(len(f.node_def) for f in graph.library.function)
    print(f"ops {mode} {devices} {extra}: {total}")


if __name__ == "__main__":
    main(sys.argv)
