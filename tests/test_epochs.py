"""`--drop_remainder`: how epochs are cut into full global batches."""

import numpy as np

from mgloop.data import epochs
from tests.test_staging import index_dataset

SEED = 5


def take(stream, steps):
    return [batch.numpy() for batch in stream.take(steps)]


def permutations(dataset, count):
    """Epoch permutations 0..count-1 of InMemoryDataset.train_indices (one epoch per batch)."""
    return take(dataset.train_indices(len(dataset.train_y), SEED), count)


def test_drop_remainder_cuts_each_epoch_on_its_own():
    dataset = index_dataset(num_train=20)  # batches of 8: two per epoch, 4 examples left
    perms = permutations(dataset, 3)
    expected = [perm[i:i + 8] for perm in perms for i in (0, 8)]
    np.testing.assert_array_equal(take(epochs.train_indices(dataset, 8, SEED), 6), expected)
    for start in range(6):  # resuming at any step reads the same batches
        np.testing.assert_array_equal(
            take(epochs.train_indices(dataset, 8, SEED, start_step=start), 6 - start),
            expected[start:])
    # The dropped examples change from epoch to epoch.
    dropped = [set(perm[16:].tolist()) for perm in perms]
    assert dropped[0] != dropped[1] or dropped[1] != dropped[2]


def test_keeping_the_remainder_carries_it_into_the_next_epoch():
    dataset = index_dataset(num_train=20)
    perms = permutations(dataset, 2)
    kept = take(epochs.train_indices(dataset, 8, SEED, drop_remainder=False), 5)
    np.testing.assert_array_equal(np.concatenate(kept), np.concatenate(perms))  # none skipped
    np.testing.assert_array_equal(kept[2], np.concatenate([perms[0][16:], perms[1][:4]]))


def test_both_are_one_stream_when_the_batch_divides_the_epoch():
    dataset = index_dataset(num_train=24)
    dropped = take(epochs.train_indices(dataset, 8, SEED, start_step=2), 7)
    kept = take(epochs.train_indices(dataset, 8, SEED, start_step=2, drop_remainder=False), 7)
    np.testing.assert_array_equal(dropped, kept)


def test_batches_gather_the_examples_of_the_indices():
    dataset = index_dataset(num_train=20)
    indices = take(epochs.train_indices(dataset, 8, SEED, start_step=3), 2)
    batches = take(epochs.train_batches(dataset, 8, SEED, start_step=3).map(lambda x, y: x), 2)
    for idx, x in zip(indices, batches):
        np.testing.assert_array_equal(x[:, 0, 0, 0], idx)
