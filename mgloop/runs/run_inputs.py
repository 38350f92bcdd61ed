"""The run's inputs from its validated `Config`: the training and eval inputs of what the
user gave (data/user_input.py), each reading the data options (`config.data`) and a
`data.Reading`, what an input needs of the run beyond them."""

from __future__ import annotations

from absl import logging

from mgloop import data
from mgloop.data import partition
from mgloop.runs.config import Config


def reading(config: Config, workers=None) -> data.Reading:
    """What the inputs of validated `config` need beyond its data options: this worker
    (`workers`: the cluster.Cluster or None), the seed, the micro-batches per step, the
    clients --partition deals to and the folder partition.json goes to."""
    num_workers = workers.num_workers if workers is not None else 1
    clients = partition.clients_of(config.method_at, config.nodes, config.num_towers,
                                   num_workers)
    return data.Reading(workers=workers, seed=config.seed,
                        micro_batches=config.accumulation_steps, clients=clients,
                        logdir=config.logdir)


def inputs(config: Config, dataset, workers) -> tuple:
    """(the training input, the eval input or None: nothing is evaluated) of the run's
    (train_data, eval_data) (user_input.py); one log line. Readers may start TensorFlow:
    after the devices, before variables."""
    train_data, eval_data = dataset
    run = reading(config, workers)
    train = data.as_input(train_data, config.data, run, "train_data")
    evaluation = (data.as_input(eval_data, config.data, run, "eval_data")
                  if eval_data is not None else train if train.has_eval_split else None)
    logging.info("training data: %s; eval data: %s", train.description,
                 evaluation.description if evaluation else "none (nothing is evaluated)")
    return train, evaluation
