"""The update of the replicated modes on big_mlp's 41M parameters (its ten variables' shapes) in
`--towers` copies on as many logical CPU devices, side by side over `--rounds` rounds:

    python -m experiments.updates fused       (Keras's SGD update against the fused kernel)
    python -m experiments.updates sharded     (every copy updated whole, or each its chunk)

`fused`: one SGD-with-momentum update (mu 0.9) of every copy, by Keras's own `update_step`
and by mgloop's `optim.fused_sgd`; with the largest difference between the two after one
update.

`sharded`: what the ring's step does after the towers' backward pass, from the towers'
gradients (on their devices) to updated copies, in two ways:

- the ring today: the ring's all-reduce (mgloop's `ring_all_reduce`: reduce-scatter, then
  all-gather of the summed gradient chunks), then every copy's fused update of the whole
  variable: T updates of P parameters;
- a sharded update (ZeRO stage 1, Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
  Toward Training Trillion Parameter Models"): the reduce-scatter alone
  (`ring_reduce_scatter`), then each tower's fused update of the one chunk it holds summed
  (P / T parameters, its momentum only for that chunk), then the ring's all-gather
  (`ring_all_gather`) of the updated WEIGHT chunks, assigned to every copy;

and the all-reduce alone, for scale. Both ways apply the same element-wise update to the
same mean chunk, so their copies agree bit for bit (the largest difference is printed).
It measures the update alone, apart from a step; `--shard_update`
(step/sharded_update.py) is the same in mgloop's step, measured in one with
`experiments/bench.py --modes=ring+shard`.
"""

from __future__ import annotations

import os


from absl import app, flags

from experiments import benchlib
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

FLAGS = flags.FLAGS
flags.DEFINE_integer("rounds", 7, "rounds side by side")
flags.DEFINE_integer("towers", 4, "copies, one per logical CPU device")
flags.DEFINE_string("json_out", None, "write the rows (with command, settings, machine) here")

LEARNING_RATE, MOMENTUM = 0.01, 0.9


def big_mlp_shapes() -> list[tuple[int, ...]]:
    from mgloop.models import big_mlp
    sizes = [8000, *big_mlp.WIDTHS, 1]
    return [shape for m, n in zip(sizes, sizes[1:]) for shape in ((m, n), (n,))]


def variables_with_sgd(device: str, values, fused: bool = True):
    """Variables holding `values` on `device` and a built Keras SGD (momentum) for them: as
    the runs build a copy's optimizer (`optim.build_optimizers`: the fused kernel, placed
    beside the variables), or, unless `fused`, with Keras's own `update_step`."""
    import keras
    import tensorflow as tf
    from mgloop.training import optim
    from mgloop.training.variables import VariableCopy

    def sgd():
        return keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)
    with tf.device(device):
        variables = [tf.Variable(value) for value in values]
    if fused:
        copy = VariableCopy(device, variables, [])
        optim.build_optimizers([copy], sgd)
        return variables, copy.optimizer
    with tf.device(device):
        optimizer = sgd()
        optimizer.build(variables)
    return variables, optimizer


def largest_difference(first, second) -> float:
    import numpy as np
    return max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(first, second))


def side_by_side(runs: dict, baseline: str, difference: float, change: float,
                 header: str) -> None:
    """Times `runs` (name -> (tf.function, ...)) over the rounds and publishes the table.
    `difference`: the largest between the ways after one step; `change`: the largest change
    one step made (so that a difference of 0 is seen to compare updated weights)."""
    rows = benchlib.summarize(benchlib.rounds(
        {name: benchlib.timer(run) for name, (run, *_) in runs.items()}, FLAGS.rounds,
        warmup=1), "case")
    benchlib.add_ratio(rows, "median", baseline)
    for row in rows:
        row.update(ms=1e3 * row["median"], mad_ms=1e3 * row["mad"])
    benchlib.publish(
        f"{header}; after one step the weights changed by up to {change:.1e}, and the ways "
        f"differ by up to {difference:.1e}", rows,
        [("case", "case", "s"), ("ms", "median (ms)", ".1f"), ("mad_ms", "± MAD (ms)", ".1f"),
         ("ratio", f"ratio to {baseline}", ".2f")], FLAGS.json_out,
        {"towers": FLAGS.towers, "rounds": FLAGS.rounds, "largest_difference": difference,
         "largest_change": change})


def setup():
    import numpy as np
    import tensorflow as tf
    from mgloop.cluster import devices
    device_set = devices.setup(devices.parse(f"cpu:{FLAGS.towers}"))
    shapes = big_mlp_shapes()
    start = [tf.random.normal(shape, seed=5) for shape in shapes]
    header = (f"{sum(int(np.prod(s)) for s in shapes):,} parameters x {FLAGS.towers} copies, "
              f"{FLAGS.rounds} rounds side by side")
    return device_set, shapes, start, header


def fused(args) -> None:
    del args
    import tensorflow as tf
    device_set, shapes, start, header = setup()
    towers = device_set.towers
    grads = [tf.random.normal(shape, seed=4) for shape in shapes]

    def update(fused_kernel: bool):
        copies = [variables_with_sgd(device, start, fused_kernel) for device in towers]

        @tf.function
        def run():
            for weights, optimizer in copies:
                optimizer.apply(grads, weights)
        return run, copies[0][0]
    runs = {"Keras's update_step": update(False), "optim.fused_sgd": update(True)}
    runs["Keras's update_step"][0]()
    runs["optim.fused_sgd"][0]()
    difference = largest_difference(runs["Keras's update_step"][1], runs["optim.fused_sgd"][1])
    change = largest_difference(runs["optim.fused_sgd"][1], start)
    side_by_side(runs, "Keras's update_step", difference, change, header)


def sharded(args) -> None:
    del args
    import tensorflow as tf
    from mgloop import aggregation
    from mgloop.aggregation.dense import ring
    device_set, shapes, start, header = setup()
    towers, num = device_set.towers, len(device_set.towers)
    method = aggregation.make("ring", device_set)
    grads = []
    for t, device in enumerate(towers):
        with tf.device(device):
            grads.append([tf.random.normal(shape, seed=4 + t) for shape in shapes])

    def flats(v):
        out = []
        for device, tower_grads in zip(towers, grads):
            with tf.device(device):
                out.append(tf.reshape(tower_grads[v], [-1]))
        return out

    whole = [variables_with_sgd(device, start) for device in towers]

    @tf.function(autograph=False)
    def update_whole():
        means = [ring.ring_all_reduce(method, flats(v), towers, True) for v in range(len(shapes))]
        for t, (weights, optimizer) in enumerate(whole):
            optimizer.apply([tf.reshape(mean[t], shape) for mean, shape in zip(means, shapes)],
                            weights)

    copies = []
    for device in towers:
        with tf.device(device):
            copies.append([tf.Variable(value) for value in start])
    owned = []  # per tower: the chunk it owns of every variable, with the optimizer of it
    for t, device in enumerate(towers):
        chunks = []
        for value in start:
            parts = tf.split(tf.reshape(value, [-1]),
                             ring.chunk_sizes(value.shape.num_elements(), num))
            chunks.append(parts[ring.owned_chunk(t, num)])
        owned.append(variables_with_sgd(device, chunks))

    @tf.function(autograph=False)
    def update_chunks():
        scattered = [ring.ring_reduce_scatter(method, flats(v), towers, True)
                     for v in range(len(shapes))]
        for t, (weights, optimizer) in enumerate(owned):
            c = ring.owned_chunk(t, num)
            optimizer.apply([chunks[t][c] for chunks in scattered], weights)
            with tf.device(towers[t]):
                for chunks, chunk in zip(scattered, weights):
                    chunks[t][c] = chunk.read_value()  # (after the update: tf.function orders it)
        for v, (chunks, shape) in enumerate(zip(scattered, shapes)):
            ring.ring_all_gather(method, chunks, towers)
            for t, device in enumerate(towers):
                with tf.device(device):
                    copies[t][v].assign(tf.reshape(tf.concat(chunks[t], 0), shape))

    @tf.function(autograph=False)
    def all_reduce_only():  # (one element of each result kept, so that none is pruned)
        return tf.add_n([mean[0] for v in range(len(shapes))
                         for mean in ring.ring_all_reduce(method, flats(v), towers, True)])

    update_whole()
    update_chunks()
    difference = max(largest_difference(weights, copy)
                     for (weights, _), copy in zip(whole, copies))
    change = max(largest_difference(copy, start) for copy in copies)
    side_by_side({"ring all-reduce, every copy updated whole": (update_whole,),
                  "reduce-scatter, each chunk updated, weights all-gathered": (update_chunks,),
                  "ring all-reduce alone": (all_reduce_only,)},
                 "ring all-reduce, every copy updated whole", difference, change, header)


COMMANDS = {"fused": (fused, {}), "sharded": (sharded, {})}


if __name__ == "__main__":
    app.run(lambda argv: benchlib.dispatch(argv, COMMANDS))
