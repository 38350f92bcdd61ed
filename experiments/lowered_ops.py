"""The ops a compiled training loop runs each step, as TensorFlow runs them, per op type.

    python -m experiments.lowered_ops --systems=plain_towers,ps_cpu,ring,collective
    python -m experiments.lowered_ops --systems=ps_cpu --dump=/tmp/ops

`traces.py count` counts the ops of the traced functions as Python built them; many of
those never run (Grappler folds constants, drops identities and reads whose value nothing
uses) and many that run are not there (the `_Send`/`_Recv` pairs of every edge between
two devices, the `Enter`/`Merge`/`Switch`/`NextIteration` of every loop variable once the
`while` is lowered). This counts what runs: every system (bench_systems.py's, on its
model, dataset and global batch: mgloop's modes by name, or a baseline such as
`plain_towers`) is built in this process on --towers logical CPU devices, and its loop is
run once with TensorFlow's graph collection on; the partition graphs of the loop's
function (one per device, after Grappler and the lowering of control flow) are read, and
their nodes inside the `while` (the step and the loop's own control) are counted by op
type, once per step. `--dump=DIR` writes each system's nodes (op, name, device), one a
line. The count is deterministic for a given TensorFlow and model; compare systems, or a
change against its parent commit (run it on both).
"""

from __future__ import annotations

import collections
import os

from absl import app, flags

from experiments import bench_systems

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_FLAGS = flags.FLAGS
flags.DEFINE_list("systems", ["plain_towers", "ps_cpu"], "mgloop --aggregation modes, or "
                  "baselines of bench_systems.py (plain_towers, single_device, ...)")
flags.DEFINE_string("model", "mlp", "model of every system")
flags.DEFINE_string("dataset", "synthetic", "dataset of every system")
flags.DEFINE_integer("global_batch_size", 128, "global batch of every system")
flags.DEFINE_integer("towers", 4, "logical CPU devices (towers) of every system")
flags.DEFINE_string("dump", None, "a folder: each system's loop nodes, one a line")

IN_LOOP = ("while/", "_cloopwhile")  # the lowered loop's nodes (its body and control)


def loop_ops(system: str):
    """(Counter of op types, [(op, name, device)]) of the nodes inside the loop's while."""
    from tensorflow.python.eager import context
    name = system if system in bench_systems.BASELINES else bench_systems.MGLOOP_PREFIX + system
    spec = bench_systems.Spec(system=name, model=_FLAGS.model, dataset=_FLAGS.dataset,
                              towers=1 if system == "single_device" else _FLAGS.towers,
                              global_batch=_FLAGS.global_batch_size, steps=2)
    built = bench_systems.build(spec)
    context.enable_graph_collection()  # before the loop's function is instantiated
    try:
        built.run()
        metadata = context.export_run_metadata()
    finally:
        context.disable_graph_collection()
    graphs = max(metadata.function_graphs,  # the loop's function: the largest run
                 key=lambda f: sum(len(g.node) for g in f.partition_graphs)).partition_graphs
    nodes = [(n.op, n.name, n.device) for g in graphs for n in g.node
             if n.name.startswith(IN_LOOP)]
    return collections.Counter(op for op, _, _ in nodes), nodes


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from mgloop.cluster import devices
    devices.configure_logical_cpus(_FLAGS.towers)
    counts = {}
    for system in _FLAGS.systems:
        counts[system], nodes = loop_ops(system)
        if _FLAGS.dump:
            os.makedirs(_FLAGS.dump, exist_ok=True)
            with open(os.path.join(_FLAGS.dump, f"{system}.txt"), "w") as handle:
                handle.writelines(f"{op}\t{name}\t{device}\n" for op, name, device in nodes)
    systems = list(counts)
    print(f"ops run per step inside the loop ({_FLAGS.model}, {_FLAGS.towers} towers, "
          f"global batch {_FLAGS.global_batch_size})")
    print("| op type | " + " | ".join(systems) + " |\n|---|" + "---|" * len(systems))
    print("| **all** | " + " | ".join(str(sum(counts[s].values())) for s in systems) + " |")
    types = sorted(set().union(*counts.values()), key=lambda t: -max(c[t] for c in
                                                                       counts.values()))
    for op_type in types:
        print(f"| {op_type} | " + " | ".join(str(counts[s][op_type]) for s in systems) + " |")


if __name__ == "__main__":
    app.run(main)
