"""Every method between W real workers against W simulated nodes in one process.

    python experiments/check_methods_between_workers.py --workers=3
    python experiments/check_methods_between_workers.py --workers=2 --methods=topk,median

Starts W worker processes (`mgloop.launch`, TF_CONFIG, gRPC, collective ops) of
`--devices_per_worker` each, which train every method in turn for --steps steps of the
MLP (tests/workers/methods_between_workers.py), then trains each method in this
process on W * towers logical CPUs with --nodes=W, and prints per method the largest
|w_real - w_simulated| over the exported weights (0.0: bit for bit), or the one-line
refusal both gave. The suite's tests/test_nodes_workers.py asserts a few of these.
"""

from __future__ import annotations

import io
import os
import sys

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FLAGS = flags.FLAGS
flags.DEFINE_integer("workers", 2, "worker processes (each a node)")
flags.DEFINE_integer("towers", 1, "towers per worker")
flags.DEFINE_integer("steps", 4, "training steps per method")
flags.DEFINE_list("methods", [
    "adasum", "bulyan:f=0", "delay", "dgc:momentum=0", "diloco:period=2", "drop", "efsignsgd",
    "geomedian", "krum:f=0", "localsgd:period=2", "median", "multikrum:f=0,m=2", "onebit",
    "powersgd", "qsgd", "randomk", "signsgd", "terngrad", "threshold", "topk",
    "trimmed_mean:trim=1", "streaming_diloco:period=2,fragments=2,outer_bits=4"],
    "aggregation specs")
flags.DEFINE_string("root", "/tmp/mgloop_methods_between_workers", "where the runs go")


def main(argv):
    del argv
    from mgloop.cluster import devices
    from mgloop import launch
    towers = FLAGS.workers * FLAGS.towers
    devices.configure_logical_cpus(towers)
    import keras
    import numpy as np
    import mgloop
    from mgloop.errors import ConfigError
    from tests.workers.methods_between_workers import config_for
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
    print(f"{FLAGS.workers} workers x cpu:{FLAGS.towers} against --nodes={FLAGS.workers} on "
          f"cpu:{towers}, {FLAGS.steps} steps of the MLP, global batch {batch}")
    for index, spec in enumerate(FLAGS.methods):
        try:
            mgloop.run(config_for(spec, simulated, index, f"cpu:{towers}", nodes=FLAGS.workers,
                                  global_batch_size=batch, train_steps=FLAGS.steps,
                                  steps_per_loop=FLAGS.steps))
        except ConfigError as error:
            print(f"  {spec:52s} refused: {error}")
            continue
        pair = [keras.models.load_model(os.path.join(root, str(index), "export", "model.keras"))
                .get_weights() for root in (real, simulated)]
        difference = max(float(np.max(np.abs(a - b))) for a, b in zip(*pair))
        print(f"  {spec:52s} max |real - simulated| = {difference:.3g}")


if __name__ == "__main__":
    app.run(main)
