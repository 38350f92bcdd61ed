"""PowerSGD's compression ratios on the CIFAR ResNet-18 between 2 nodes, from summary.json.

Vogels, Karimireddy and Jaggi 2019 (PowerSGD, Table 3 / Appendix) report, for the CIFAR-10
ResNet-18 (11.17 M trainable parameters), a data volume per epoch 243x / 136x / 72x below
the dense all-reduce's at rank 1 / 2 / 4. This runs `mgloop.run` with that model (a Keras
re-creation of the usual CIFAR ResNet-18: a 3x3 stem, four stages of two basic blocks,
64-128-256-512 channels, batch norm) on 2 simulated nodes of one tower each for a few
steps, and prints, per rank, summary.json's `link_model.compression_ratio` (the gradients
only: dense bytes between the nodes over what PowerSGD sends between them per step) and
the state bytes per step reported apart (batch norm's moving statistics).

    python -m experiments.powersgd_resnet18 --ranks=1,2,4 --steps=2
"""

from __future__ import annotations

import tempfile

from absl import app, flags


flags.DEFINE_list("ranks", ["1", "2", "4"], "PowerSGD ranks to run")
flags.DEFINE_integer("steps", 2, "training steps per rank (the ratio is the same every step)")
flags.DEFINE_integer("global_batch", 8, "global batch (4 examples per node)")
FLAGS = flags.FLAGS
PAPER = {1: 243, 2: 136, 4: 72}


def resnet18(input_shape, num_classes):
    """The CIFAR ResNet-18 (He et al. 2016's basic blocks, a 3x3 stem, no max pool)."""
    import keras
    layers = keras.layers

    def block(x, filters, stride):
        shortcut = x
        y = layers.Conv2D(filters, 3, stride, padding="same", use_bias=False)(x)
        y = layers.ReLU()(layers.BatchNormalization()(y))
        y = layers.Conv2D(filters, 3, 1, padding="same", use_bias=False)(y)
        y = layers.BatchNormalization()(y)
        if stride != 1 or shortcut.shape[-1] != filters:
            shortcut = layers.Conv2D(filters, 1, stride, use_bias=False)(x)
            shortcut = layers.BatchNormalization()(shortcut)
        return layers.ReLU()(layers.Add()([y, shortcut]))

    inputs = keras.Input(input_shape)
    x = layers.Conv2D(64, 3, 1, padding="same", use_bias=False)(inputs)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    for filters, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        x = block(x, filters, stride)
        x = block(x, filters, 1)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(num_classes)(x), name="resnet18")


def main(argv):
    del argv
    from mgloop.cluster import devices
    devices.configure_logical_cpus(2)
    import mgloop
    print(f"    python -m experiments.powersgd_resnet18 --ranks={','.join(FLAGS.ranks)} "
          f"--steps={FLAGS.steps}\n")
    print("| rank | trainable params | compression_ratio | tiers.compression_ratio_between | paper "
          "| state B/step |")
    print("|---|---|---|---|---|---|")
    for rank in map(int, FLAGS.ranks):
        with tempfile.TemporaryDirectory() as logdir:
            result = mgloop.run(mgloop.Config(
                devices="cpu:2", nodes=2, aggregation=f"powersgd:rank={rank}",
                dataset="synthetic_cifar", global_batch_size=FLAGS.global_batch,
                train_steps=FLAGS.steps, steps_per_loop=FLAGS.steps, eval_every=0,
                summary_every=0, log_every=0, logdir=logdir),
                model_fn=lambda: resnet18((32, 32, 3), 10))
            report = result["link_model"]
            params = sum(v.shape.num_elements() for v in result.model.trainable_variables)
            print(f"| {rank} | {params:,} | {report['compression_ratio']:.1f}x "
                  f"| {report['tiers']['compression_ratio_between']:.1f}x "
                  f"| {PAPER.get(rank, '—')}x | {report['state_bytes_per_step']:,.0f} |",
                  flush=True)


if __name__ == "__main__":
    app.run(main)
