"""A grid of aggregation settings, one `mgloop.train` run each, under one parent logdir.

    python experiments/sweep_aggregation.py --parent_logdir=/tmp/sweep \
        --modes=ps_cpu,reduce_broadcast,ring --pack_bytes=0,65536 -- --devices=cpu:4
    tensorboard --logdir=/tmp/sweep       (HParams tab: one session per run)

Each combination of --modes and --pack_bytes (pack_bytes > 0 only for modes
that exchange gradients and accept it) runs `python -m mgloop.train` with the
arguments after `--` (e.g. a --flagfile=experiments/<name>.flags) and
`--logdir=<parent>/<mode>-pack<bytes>`. When a run ends, its hparams
(aggregation, pack_bytes, devices, model, global batch, transport dtype) are
written into its folder, and the parent gets the HParams experiment whose
metrics are the run's own TensorBoard scalars: train/examples_per_sec,
train/loss, eval/loss, eval/accuracy. Short by default (--train_steps=60).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags, logging  # noqa: E402

_FLAGS = flags.FLAGS
flags.DEFINE_string("parent_logdir", None, "folder of the runs (one subfolder each)")
flags.mark_flag_as_required("parent_logdir")
flags.DEFINE_list("modes", ["ps_cpu", "ps_spread", "reduce_broadcast", "ring", "hierarchical",
                            "collective", "colocate"], "--aggregation values")
flags.DEFINE_list("pack_bytes", ["0"], "--pack_bytes values (0: off)")
flags.DEFINE_integer("train_steps", 60, "--train_steps of every run (unless given after --)")

HPARAMS = ("aggregation", "pack_bytes", "devices", "model", "global_batch_size",
           "transport_dtype")
METRICS = (("examples_per_sec", "train"), ("loss", "train"), ("loss", "eval"),
           ("accuracy", "eval"))


def grid(modes, pack_sizes):
    from mgloop import aggregation
    for mode in modes:
        for pack in pack_sizes:
            if pack and (not aggregation.get(mode).exchanges or mode == "ps_spread"):
                continue  # refused by Config: nothing to pack, or buckets across devices
            yield mode, pack


def write_hparams(run_dir: str, summary: dict) -> None:
    import tensorflow as tf
    from tensorboard.plugins.hparams import api as hp
    config = summary["config"]
    with tf.summary.create_file_writer(run_dir).as_default():
        hp.hparams({name: config[name] for name in HPARAMS}, trial_id=os.path.basename(run_dir))


def write_experiment(parent: str, runs: list[dict]) -> None:
    import tensorflow as tf
    from tensorboard.plugins.hparams import api as hp
    values = {name: sorted({run["config"][name] for run in runs}, key=str) for name in HPARAMS}
    hparams = [hp.HParam(name, hp.Discrete(values[name])) for name in HPARAMS]
    metrics = [hp.Metric(tag, group=group, display_name=f"{group}/{tag}")
               for tag, group in METRICS]
    with tf.summary.create_file_writer(parent).as_default():
        hp.hparams_config(hparams=hparams, metrics=metrics)


def main(argv):
    train_args = argv[1:]
    pack_sizes = [int(p) for p in _FLAGS.pack_bytes]
    runs = []
    for mode, pack in grid(_FLAGS.modes, pack_sizes):
        run_dir = os.path.join(_FLAGS.parent_logdir, f"{mode}-pack{pack}")
        command = [sys.executable, "-m", "mgloop.train", f"--train_steps={_FLAGS.train_steps}",
                   *train_args, f"--aggregation={mode}", f"--pack_bytes={pack}",
                   f"--logdir={run_dir}"]
        logging.info("running %s", " ".join(command))
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            logging.error("%s failed (%d): %s", run_dir, result.returncode, result.stderr[-2000:])
            continue
        with open(os.path.join(run_dir, "summary.json")) as handle:
            summary = json.load(handle)
        write_hparams(run_dir, summary)
        runs.append(summary)
        logging.info("%s: %.0f examples/sec, eval accuracy %.3f", run_dir,
                     summary["examples_per_sec"] or 0.0, summary["eval_accuracy"])
    if not runs:
        raise SystemExit("no run of the sweep succeeded")
    write_experiment(_FLAGS.parent_logdir, runs)
    print(f"{len(runs)} runs in {_FLAGS.parent_logdir}; tensorboard --logdir="
          f"{_FLAGS.parent_logdir} (HParams tab)")


if __name__ == "__main__":
    app.run(main)
