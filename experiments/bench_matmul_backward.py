"""The input gradient of a dense layer, two ways, side by side: dz W^T against (W dz^T)^T.

    python experiments/bench_matmul_backward.py

For z = x W (x: b x m, W: m x n), TensorFlow's MatMul gradient forms
dx = dz W^T as one MatMul with `transpose_b`; sufficient_factors.py forms the
same dx as (W dz^T)^T: W on the left untransposed, the small dz transposed. Both
are timed here on the shapes of big_mlp's second layer (W: 4000 x 2000) for the
whole global batch on one product (B rows) and for T towers' products of B/T
rows each, built in one tf.function so that they run concurrently as the
towers' do, with interleaved repeats (experiments/benchlib.py's median and
MAD). The ratio is each row's time over `dz W^T` on B rows.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402

import benchlib  # noqa: E402

_FLAGS = flags.FLAGS
flags.DEFINE_integer("rows", 512, "B: rows of dz (the global batch)")
flags.DEFINE_integer("towers", 4, "T: products of B/T rows each")
flags.DEFINE_list("kernel", ["4000", "2000"], "m,n: the kernel's shape")
flags.DEFINE_integer("repeats", 9, "timed calls per variant, interleaved")
flags.DEFINE_string("json_out", None, "also write the results here as JSON")

FORMS = {"dz W^T (TensorFlow)": "right_transposed", "(W dz^T)^T (mgloop)": "left"}


def main(argv):
    del argv
    import tensorflow as tf
    m, n = (int(d) for d in _FLAGS.kernel)
    kernel = tf.Variable(tf.random.normal([m, n], seed=1))
    dz = tf.random.normal([_FLAGS.rows, n], seed=2)

    def product(form, parts):
        @tf.function
        def run():
            sums = []
            for piece in tf.split(dz, parts):
                if form == "right_transposed":
                    dx = tf.matmul(piece, kernel, transpose_b=True)
                else:
                    dx = tf.transpose(tf.matmul(kernel, piece, transpose_b=True))
                sums.append(tf.reduce_sum(dx))
            return tf.add_n(sums)
        return run

    variants = {f"{name}, {parts} x {_FLAGS.rows // parts} rows": product(form, parts)
                for parts in (1, _FLAGS.towers) for name, form in FORMS.items()}
    for run in variants.values():
        run().numpy()  # trace and warm up
    times = {name: [] for name in variants}
    for _ in range(_FLAGS.repeats):
        for name, run in variants.items():
            began = time.perf_counter()
            run().numpy()
            times[name].append(time.perf_counter() - began)
    base, _ = benchlib.median_and_mad(times[next(iter(variants))])
    rows = []
    for name in variants:
        median, mad = benchlib.median_and_mad(times[name])
        rows.append({"variant": name, "ms": 1e3 * median, "mad_ms": 1e3 * mad,
                     "ratio": median / base})
    benchlib.report(f"dx for W {m} x {n}; command: python {' '.join(sys.argv)}", rows, [
        ("variant", "dx as", "s"), ("ms", "median (ms)", ".1f"), ("mad_ms", "± MAD (ms)", ".1f"),
        ("ratio", "ratio to dz W^T on B rows", ".2f")], _FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
