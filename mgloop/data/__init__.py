"""Datasets by `--dataset` name, and `as_input` (user_input.py): what a run reads.

`synthetic`, `synthetic_cifar` and `random_binary` are generated from the seed;
`cifar10`, `mnist` and `text` (text.py: byte tokens) read their files from `--data_dir`,
whose layout `check` verifies with plain Python (headers and sizes, no TensorFlow) during
`Config.validated()`. Real data that installs with the package (no download, no
--data_dir): `digits` (digits.py: the 1797 UCI 8x8 handwritten digits bundled beside it, checked
the same way) and `python_text` (python_text.py: byte tokens of the standard library's
own modules, sequenced like `text`). Each of these loaders returns an `InMemoryDataset`.
`--partition=dirichlet:alpha=A` (partition.py) deals a labelled in-memory dataset's
training examples to the run's clients by label-Dirichlet proportions (non-IID shards).
A `--plugin` module may `register` a dataset read from files (data larger than
memory): a function (data_dir, input_context) -> tf.data.Dataset of its training
examples or batches, and optionally one data_dir -> Dataset of its eval data.

Also here, the end of the input path: staging.py (how batches reach the towers: one
shard per tower, prefetched into per-device buffers, as tensorpack's StagingInput) and
batch_split.py (how a step's examples split among workers and towers). The rest:

    options.py       the data part of the settings (`config.data`): batch sizes, staging
    checks.py        its check, which the gate (runs/config_checks.py) calls
    catalog.py       the package's body (datasets by name, `register`), loaded on first use
    base.py          host input pipelines (tf.data) over a dataset held in memory
    synthetic.py, random_binary.py, cifar10.py, mnist.py   the datasets named above
    files.py         checks shared by the file readers, naming --data_dir and the file
    augment.py       stateless image augmentation: padded random crop, horizontal flip
    epochs.py        how epochs are cut into global batches (`--drop_remainder`)
    padding.py       short batches padded to the global batch, weighted to the real examples
    inputs.py        the run's inputs as_input makes: what a step reads, from where

May import: ground modules only. Every package above reads data through here.
"""

from mgloop import lazy_package

# Everything but the settings part (mgloop.data.options, plain Python) is loaded on first
# use from catalog.py.
__getattr__ = lazy_package.getattr_of(__name__, "mgloop.data.catalog")
