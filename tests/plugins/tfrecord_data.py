"""`--dataset=tfrecord_examples`, registered by a plugin (`--plugin=tests.plugins.tfrecord_data`):
TFRecord files in --data_dir, read as a stream (data larger than memory), as the README's
example. Each record is a tf.train.Example with features x (float, FEATURES values) and y
(int64): train-*.tfrecord for training, eval-*.tfrecord for evaluation, files in name order."""

import os

import tensorflow as tf

from mgloop import data

FEATURES = 4
SPEC = {"x": tf.io.FixedLenFeature([FEATURES], tf.float32),
        "y": tf.io.FixedLenFeature([], tf.int64)}


def parse(record):
    example = tf.io.parse_single_example(record, SPEC)
    return example["x"], tf.cast(example["y"], tf.int32)


def read(data_dir, prefix):
    files = sorted(tf.io.gfile.glob(os.path.join(data_dir, f"{prefix}-*.tfrecord")))
    return tf.data.TFRecordDataset(files).map(parse)


def train(data_dir, input_context):
    # one worker reads every file; several: worker i every num_input_pipelines-th record
    records = read(data_dir, "train")
    return records.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)


data.register("tfrecord_examples", train, eval=lambda data_dir: read(data_dir, "eval"),
              files="train-*.tfrecord and eval-*.tfrecord", num_classes=3)


def write(path, xs, ys) -> None:
    """Writes examples (x [n, FEATURES] float, y [n] int) as one TFRecord file."""
    with tf.io.TFRecordWriter(path) as writer:
        for x, y in zip(xs, ys):
            example = tf.train.Example(features=tf.train.Features(feature={
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=list(map(float, x)))),
                "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(y)]))}))
            writer.write(example.SerializeToString())
