"""Every method between nodes: what it sends and costs, and whether real workers agree.

    python -m experiments.methods_between_nodes cost --models=resnet20 --rounds=3 --steps=10
    python -m experiments.methods_between_nodes cost --models=transformer_lm --rounds=3 --steps=10 \
        --text_dir=DIR   (UTF-8 text files for the Transformer LM's tokens)
    python -m experiments.methods_between_nodes workers --workers=3
    python -m experiments.methods_between_nodes workers --workers=2 --methods=topk,median

`cost`: bytes between nodes, ratio to dense, modelled step times and the
measured compute overhead of every method between 2 simulated nodes. Per model, one
process builds every method of `--methods` on `--devices=cpu:4 --nodes=2` (2 nodes of 2
towers, the method between the nodes, `reduce` inside them), runs one loop of each (its
trace; the traffic is counted as the step is traced), then `--rounds` rounds side by
side in rotated order, each timing one loop of `--steps` steps of every method
(experiments/benchlib.py). Reported per method:

  between B/step   the busiest device's gradient bytes between nodes per step, counted
                   as the step is traced (packed payloads: bitpacking.py)
  ratio            a float32 ring all-reduce of the gradients between the 2 nodes over it
  step / dense     the median step time over that of the first method (`ring`, the dense
                   exact method), measured side by side: the compute cost of compressing
  modelled ms      compute (the measured median step) + the two-tier exchange model
                   (link_model.tiered_exchange_seconds) with 100gbit,2us within a node
                   and 1, 10 or 100 gbit/s (50us) between nodes

Simulated towers share 2 cores: compare the methods with each other, not with a cluster.

`workers` (a check, not a timing): every method between W real workers against W
simulated nodes in one process. Starts W worker processes (`mgloop.launch`, TF_CONFIG,
gRPC, collective ops) of `--towers` devices each, which train every method in turn for
--steps steps of the MLP (tests/workers/methods_between_workers.py), then trains each
method in this process on W * towers logical CPUs with --nodes=W, and prints per method
the largest |w_real - w_simulated| over the exported weights (0.0: bit for bit), or the
one-line refusal both gave. The suite's tests/test_nodes_workers.py asserts a few of these.
"""

from __future__ import annotations

import io
import os
import sys

from absl import app, flags

from experiments import benchlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FLAGS = flags.FLAGS
flags.DEFINE_list("methods", None, "aggregation specs (default per command: COST_METHODS, "
                  "the first the dense baseline of `step / dense`; WORKER_METHODS)")
flags.DEFINE_integer("steps", None, "steps per timed loop (cost, default 10); training steps "
                     "per method (workers, default 4)")
flags.DEFINE_list("models", ["resnet20", "transformer_lm"], "cost: models to measure")
flags.DEFINE_integer("rounds", 3, "cost: rounds side by side")
flags.DEFINE_integer("warmup", 1, "cost: untimed loops of each method before the rounds")
flags.DEFINE_integer("global_batch", 32, "cost: global batch")
flags.DEFINE_string("text_dir", None, "cost: a folder of UTF-8 text files for transformer_lm "
                    "(--dataset=text)")
flags.DEFINE_string("json_out", None, "cost: write the rows (with command, settings, machine) "
                    "here")
flags.DEFINE_integer("workers", 2, "workers: worker processes (each a node)")
flags.DEFINE_integer("towers", 1, "workers: towers per worker")
flags.DEFINE_string("root", "/tmp/mgloop_methods_between_workers", "workers: where the runs go")

COST_METHODS = [
    "ring", "topk:ratio=0.01", "randomk:ratio=0.01", "threshold:value=0.01",
    "dgc:ratio=0.01,momentum=0", "qsgd:levels=8", "terngrad", "onebit", "signsgd",
    "efsignsgd", "powersgd:rank=2", "localsgd:period=4", "diloco:period=4",
    "streaming_diloco:period=4,fragments=2,outer_bits=4", "delay:d=1",
    "drop:k=1", "adasum", "median", "trimmed_mean:trim=0", "geomedian"]
WORKER_METHODS = [
    "adasum", "bulyan:f=0", "delay", "dgc:momentum=0", "diloco:period=2", "drop", "efsignsgd",
    "geomedian", "krum:f=0", "localsgd:period=2", "median", "multikrum:f=0,m=2", "onebit",
    "powersgd", "qsgd", "randomk", "signsgd", "terngrad", "threshold", "topk",
    "trimmed_mean:trim=1", "streaming_diloco:period=2,fragments=2,outer_bits=4"]
BETWEEN = ("1gbit,50us", "10gbit,50us", "100gbit,50us")
WITHIN = "100gbit,2us"


def measure(model: str) -> list[dict]:
    from mgloop.observe import link_model, link_report
    systems = {}
    for spec in FLAGS.methods:
        optimizer = "sgd" if spec.startswith("dgc") else "momentum"
        data = ({"dataset": "text", "data_dir": FLAGS.text_dir} if model == "transformer_lm"
                else {})  # tokens, from the UTF-8 files of --text_dir
        trainer, batches = benchlib.build(model, FLAGS.global_batch, devices="cpu:4",
                                          nodes=2, aggregation=spec, optimizer=optimizer,
                                          **data)
        trainer.train_loop(batches, FLAGS.steps)  # traces, counts the traffic
        systems[spec] = trainer, batches
    runs = {spec: benchlib.timer(lambda t=trainer, b=batches: t.train_loop(b, FLAGS.steps),
                                 FLAGS.steps)
            for spec, (trainer, batches) in systems.items()}
    rows = benchlib.summarize(benchlib.rounds(runs, FLAGS.rounds, FLAGS.warmup), "method")
    benchlib.add_ratio(rows, "median", FLAGS.methods[0], "overhead", "method")
    links = [link_model.parse(f"within:{WITHIN}")] + [link_model.parse(f"between:{text}")
                                                       for text in BETWEEN]
    for row in rows:
        trainer = systems[row["method"]][0]
        step = row["median"]
        # the bytes and modelled exchange per step, averaged over the steps trained
        schedule = link_report.Schedule(trainer.aggregation.traffic,
                                        int(trainer.global_step.numpy()))
        report = link_report.report(schedule, links, step, link_report.gradient_bytes_of(trainer),
                                    num_nodes=2)
        row.update(model=model, between=report["gradient_bytes_per_step"],
                   ratio=report["compression_ratio"], step_ms=1e3 * step)
        for link in links[1:]:
            row[link.name.split(",")[0]] = 1e3 * report["links"][link.tag][
                "step_seconds_no_overlap"]
    return rows


def cost(args) -> None:
    del args
    from mgloop.cluster import devices
    devices.configure_logical_cpus(4)
    rows = []
    for model in FLAGS.models:
        rows += measure(model)
    columns = [("model", "model", "s"), ("method", "method", "s"),
               ("between", "between B/step", ",.0f"), ("ratio", "ratio", ".1f"),
               ("step_ms", "step ms", ".1f"), ("overhead", "step / dense", ".2f")]
    columns += [(b.split(",")[0], f"modelled ms @{b.split(',')[0]}", ".1f") for b in BETWEEN]
    benchlib.publish(f"2 nodes x 2 towers (cpu:4), global batch {FLAGS.global_batch}, "
                     f"{FLAGS.rounds} rounds of {FLAGS.steps} steps; within {WITHIN}",
                     rows, columns, FLAGS.json_out,
                     {"models": FLAGS.models, "methods": FLAGS.methods, "steps": FLAGS.steps,
                      "rounds": FLAGS.rounds, "warmup": FLAGS.warmup,
                      "global_batch": FLAGS.global_batch})


def workers(args) -> None:
    del args
    from mgloop.cluster import devices
    from mgloop import launch
    towers = FLAGS.workers * FLAGS.towers
    devices.configure_logical_cpus(towers)
    import keras
    import numpy as np
    import mgloop
    from mgloop.errors import ConfigError
    from mgloop.runs import prepare
    batch = 32 * towers
    settings = [f"--global_batch_size={batch}", f"--train_steps={FLAGS.steps}",
                f"--steps_per_loop={FLAGS.steps}"]
    real, simulated = os.path.join(FLAGS.root, "real"), os.path.join(FLAGS.root, "simulated")
    out = io.StringIO()
    code = launch.launch(FLAGS.workers, f"cpu:{FLAGS.towers}", [], grace=30.0, out=out,
                         command=[sys.executable, os.path.join(
                             ROOT, "tests", "workers", "methods_between_workers.py"),
                             *settings, real, *FLAGS.methods])
    if code:
        print(out.getvalue()[-5000:])
        raise SystemExit(f"the workers failed (exit code {code})")
    print(f"command: {benchlib.command_line()}")
    print(f"{FLAGS.workers} workers x cpu:{FLAGS.towers} against --nodes={FLAGS.workers} on "
          f"cpu:{towers}, {FLAGS.steps} steps of the MLP, global batch {batch}")
    for index, spec in enumerate(FLAGS.methods):
        try:
            mgloop.run(prepare.method_config(  # as the workers' (tests/workers/)
                spec, os.path.join(simulated, str(index)), devices=f"cpu:{towers}",
                nodes=FLAGS.workers, global_batch_size=batch, train_steps=FLAGS.steps,
                steps_per_loop=FLAGS.steps))
        except ConfigError as error:
            print(f"  {spec:52s} refused: {error}")
            continue
        pair = [keras.models.load_model(os.path.join(root, str(index), "export", "model.keras"))
                .get_weights() for root in (real, simulated)]
        difference = max(float(np.max(np.abs(a - b))) for a, b in zip(*pair))
        print(f"  {spec:52s} max |real - simulated| = {difference:.3g}")


COMMANDS = {"cost": (cost, {"methods": COST_METHODS, "steps": 10}),
            "workers": (workers, {"methods": WORKER_METHODS, "steps": 4})}


if __name__ == "__main__":
    app.run(lambda argv: benchlib.dispatch(argv, COMMANDS))
