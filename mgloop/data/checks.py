"""The data part's check (`config.data`, data/options.py), which the gate
(runs/config_checks.py) calls before any device or variable exists.

A module of its own, so that options.py stays data only: the checks it calls live beside
what they refuse (staging.py, catalog.py), which import options.py, never the other way
round. Importing it loads TensorFlow (catalog.py's loaders).
"""

from __future__ import annotations

import dataclasses

from mgloop.data import catalog, staging
from mgloop.data.options import DataOptions
from mgloop.settings import Context


def check(options: DataOptions, context: Context) -> DataOptions:
    """Refuses bad data settings in one line (staging.py, then catalog.py: --dataset and
    its files, --sequence_length, the batch over `context.num_towers`, --partition);
    returns the options resolved: --data_dir expanded, both batch sizes (the global one
    split over the towers), and a sequenced dataset's default --sequence_length."""
    staging.check_staging(options)
    global_batch, data_dir = catalog.check_dataset_and_batch(options, context.num_towers,
                                                             context.devices_flag)
    catalog.check_partition(options)
    return dataclasses.replace(options, data_dir=data_dir, global_batch_size=global_batch,
                               batch_size_per_tower=global_batch // context.num_towers,
                               sequence_length=catalog.sequence_length_of(options))
