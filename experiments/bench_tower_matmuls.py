"""big_mlp's large products on one device's B rows against T towers' B/T rows each.

    python experiments/bench_tower_matmuls.py

What remains of big_mlp's tower tax once its kernels are factored
(mgloop/step/sufficient_factors.py) is in the products every tower runs on its own
rows. Timed here, side by side:

- forward, z = x W on the first layer (W: 8000 x 4000): every tower reads W;
- backward, the input gradient of the second layer (W: 4000 x 2000) in
  TensorFlow's form dx = dz W^T (`transpose_b`) and in mgloop's (W dz^T)^T.

Each variant multiplies B rows at once, or T pieces of B/T rows built in one
tf.function so that they run concurrently as the towers' do; repeats are
interleaved (experiments/benchlib.py's median and MAD). Ratios are to the same
product's one-device row in TensorFlow's form.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402
import tensorflow as tf  # noqa: E402  (no logical devices to configure: the default CPU)

import benchlib  # noqa: E402

_FLAGS = flags.FLAGS
flags.DEFINE_integer("rows", 512, "B: rows (the global batch)")
flags.DEFINE_integer("towers", 4, "T: pieces of B/T rows each")
flags.DEFINE_list("forward_kernel", ["8000", "4000"], "m,n of the forward product's W")
flags.DEFINE_list("backward_kernel", ["4000", "2000"], "m,n of the input gradient's W")
flags.DEFINE_integer("repeats", 9, "timed calls per variant, interleaved")
flags.DEFINE_string("json_out", None, "also write the results here as JSON")

# form -> f(rows piece, kernel): "forward" is x W, "backward" forms dx from dz
FORMS = {
    "forward x W": lambda x, w: tf.matmul(x, w),
    "backward dz W^T (TensorFlow)": lambda dz, w: tf.matmul(dz, w, transpose_b=True),
    "backward (W dz^T)^T (mgloop)": lambda dz, w: tf.transpose(tf.matmul(w, dz, transpose_b=True)),
}


def main(argv):
    del argv
    shapes = {"forward": [int(d) for d in _FLAGS.forward_kernel],
              "backward": [int(d) for d in _FLAGS.backward_kernel]}
    kernels = {kind: tf.Variable(tf.random.normal(shape, seed=1))
               for kind, shape in shapes.items()}
    rows = {"forward": tf.random.normal([_FLAGS.rows, shapes["forward"][0]], seed=2),
            "backward": tf.random.normal([_FLAGS.rows, shapes["backward"][1]], seed=3)}

    def product(form, parts):
        kind = form.split()[0]

        @tf.function
        def run():
            return tf.add_n([tf.reduce_sum(FORMS[form](piece, kernels[kind]))
                             for piece in tf.split(rows[kind], parts)])
        return run

    variants = {(form, parts): product(form, parts)
                for form in FORMS for parts in (1, _FLAGS.towers)}
    for run in variants.values():
        run().numpy()  # trace and warm up
    times = {key: [] for key in variants}
    for _ in range(_FLAGS.repeats):
        for key, run in variants.items():
            began = time.perf_counter()
            run().numpy()
            times[key].append(time.perf_counter() - began)
    medians = {key: benchlib.median_and_mad(t)[0] for key, t in times.items()}
    baseline = {"forward": medians[("forward x W", 1)],
                "backward": medians[("backward dz W^T (TensorFlow)", 1)]}
    rows_out = []
    for (form, parts), run_times in times.items():
        median, mad = benchlib.median_and_mad(run_times)
        rows_out.append({"product": f"{form}, {parts} x {_FLAGS.rows // parts} rows",
                         "ms": 1e3 * median, "mad_ms": 1e3 * mad,
                         "ratio": median / baseline[form.split()[0]]})
    benchlib.report(
        f"forward W {'x'.join(_FLAGS.forward_kernel)}, backward W "
        f"{'x'.join(_FLAGS.backward_kernel)}; command: python {' '.join(sys.argv)}", rows_out, [
            ("product", "product", "s"), ("ms", "median (ms)", ".1f"),
            ("mad_ms", "± MAD (ms)", ".1f"),
            ("ratio", "ratio to one device's B rows, TensorFlow's form", ".2f")], _FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
