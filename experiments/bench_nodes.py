"""Bytes between nodes, ratio to dense, modelled step times and the measured compute
overhead of every method between 2 simulated nodes (issue 24).

    python experiments/bench_nodes.py --models=resnet20,transformer_lm --rounds=3 \
        --text_dir=DIR   (UTF-8 text files for the Transformer LM's tokens)

Per model, one process builds every method on `--devices=cpu:4 --nodes=2` (2 nodes of 2
towers, the method between the nodes, `reduce` inside them) and then runs `--rounds`
rounds; each round times `--steps` steps of every method in turn (interleaved, so
that the machine's noise falls on all alike). Reported per method:

  between B/step   the busiest device's gradient bytes between nodes per step, counted
                   as the step is traced (packed payloads: bitpacking.py)
  ratio            a float32 ring all-reduce of the gradients between the 2 nodes over it
  step / dense     the median step time over that of `ring` (the dense exact method),
                   measured side by side: the compute cost of compressing
  modelled ms      compute (the measured median step) + the two-tier exchange model
                   (link_model.tiered_exchange_seconds) with 100gbit,2us within a node
                   and 1, 10 or 100 gbit/s (50us) between nodes

Simulated towers share 2 cores: compare the methods with each other, not with a cluster.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["resnet20", "transformer_lm"], "models to measure")
flags.DEFINE_list("methods", [
    "ring", "topk:ratio=0.01", "randomk:ratio=0.01", "threshold:value=0.01",
    "dgc:ratio=0.01,momentum=0", "qsgd:levels=8", "terngrad", "onebit", "signsgd",
    "efsignsgd", "powersgd:rank=2", "localsgd:period=4", "diloco:period=4",
    "streaming_diloco:period=4,fragments=2,outer_bits=4", "delay:d=1",
    "drop:k=1", "adasum", "median", "trimmed_mean:trim=0", "geomedian"],
    "methods between the nodes; the first is the dense baseline of `step / dense`")
flags.DEFINE_integer("steps", 10, "steps per timed call")
flags.DEFINE_integer("rounds", 3, "interleaved rounds of every method")
flags.DEFINE_integer("global_batch", 32, "global batch")
flags.DEFINE_string("json_out", None, "write the rows here as JSON")
flags.DEFINE_string("text_dir", None, "a folder of UTF-8 text files for transformer_lm "
                    "(--dataset=text)")

BETWEEN = ("1gbit,50us", "10gbit,50us", "100gbit,50us")
WITHIN = "100gbit,2us"


def measure(model: str) -> list[dict]:
    from experiments import benchlib
    from mgloop.observe import link_model
    systems = {}
    for spec in FLAGS.methods:
        optimizer = "sgd" if spec.startswith("dgc") else "momentum"
        data = ({"dataset": "text", "data_dir": FLAGS.text_dir} if model == "transformer_lm"
                else {})  # tokens, from the UTF-8 files of --text_dir
        trainer, batches = benchlib.build(model, FLAGS.global_batch, devices="cpu:4",
                                          nodes=2, aggregation=spec, optimizer=optimizer,
                                          **data)
        trainer.train_loop(batches, FLAGS.steps)  # traces, counts the traffic
        systems[spec] = (trainer, batches, [])
    for _ in range(FLAGS.rounds):
        for spec, (trainer, batches, times) in systems.items():
            start = time.perf_counter()
            trainer.train_loop(batches, FLAGS.steps)
            times.append((time.perf_counter() - start) / FLAGS.steps)
    within = link_model.parse(f"within:{WITHIN}")
    rows, dense = [], None
    for spec, (trainer, _, times) in systems.items():
        step = benchlib.median_and_mad(times)[0]
        dense = dense or step
        traffic = trainer.aggregation.traffic
        gradient_bytes = sum(4 * v.shape.num_elements() for v in trainer.copies[0].trainable)
        tiers = link_model.tiers_report(traffic, gradient_bytes, 2)
        row = {"model": model, "method": spec,
               "between": tiers["between"]["gradient"]["bytes_per_device"],
               "ratio": tiers["compression_ratio_between"], "step_ms": 1e3 * step,
               "overhead": step / dense}
        for text in BETWEEN:
            seconds = link_model.tiered_exchange_seconds(
                traffic, within, link_model.parse(f"between:{text}"))
            row[text.split(",")[0]] = 1e3 * (step + seconds)
        rows.append(row)
    return rows


def main(argv):
    del argv
    from experiments import benchlib
    from mgloop.cluster import devices
    devices.configure_logical_cpus(4)
    rows = []
    for model in FLAGS.models:
        rows += measure(model)
    columns = [("model", "model", "s"), ("method", "method", "s"),
               ("between", "between B/step", "d"), ("ratio", "ratio", ".1f"),
               ("step_ms", "step ms", ".1f"), ("overhead", "step / dense", ".2f")]
    columns += [(b.split(",")[0], f"modelled ms @{b.split(',')[0]}", ".1f") for b in BETWEEN]
    benchlib.report(f"2 nodes x 2 towers (cpu:4), global batch {FLAGS.global_batch}, "
                    f"{FLAGS.rounds} rounds of {FLAGS.steps} steps; within {WITHIN}",
                    rows, columns, FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
