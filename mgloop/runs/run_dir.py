"""The run's folders on disk, as `Config.validated()` checks them: a fresh logdir when none
is given, the write probes of --logdir and --export_dir, and the comparison of a resumed
run's settings with the `config.json` of the run whose checkpoints it continues.

Nothing here creates a device or a variable; the only side effect is creating the logdir
(with a probe file, removed at once) that `prepare` has checked.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import tempfile

from absl import logging

from mgloop import aggregation
from mgloop.errors import ConfigError
from mgloop.observe import summaries
from mgloop.runs import checkpoint_files

CONFIG_FILENAME = "config.json"  # written into the logdir when a run starts
# Settings a resumed run must keep, as a change would silently make it another run than
# the one its checkpoint continues:
# - model, optimizer, mixed_precision shape the checkpointed variables (the loss scale of
#   mixed_float16 lives in the optimizer);
# - dataset and seed are the data: the synthetic task is generated from the seed, and for
#   every dataset the seed is the epochs' permutation, so another seed would make step s
#   read examples the run has already used in this epoch and skip others;
# - global_batch_size, accumulation_steps and drop_remainder fix what step s reads (global
#   batches s*K .. s*K+K-1 of the stream cut per --drop_remainder, data/epochs.py): another
#   value resumes at another place of the stream, and another global batch also means
#   another gradient noise and learning rate per example;
# - mlp_width, mlp_depth shape mlp's, lm_layers, lm_width, lm_heads transformer_lm's
#   variables, sequence_length cuts
#   the text into other examples (mgloop/data/text.py);
# - partition deals the examples to the clients (mgloop/data/partition.py): another one
#   reads other examples at step s.
# The others (learning rate, schedule, momentum, weight decay, devices, aggregation,
# data_dir of the same dataset, train_steps, ...) may change: a resume lists those that
# differ in one log line. The tower count and layout do not enter a checkpoint.
CHECKPOINT_SHAPING = ("model", "dataset", "optimizer", "mixed_precision", "accumulation_steps",
                      "seed", "global_batch_size", "drop_remainder", "sequence_length",
                      "mlp_width", "mlp_depth", "lm_layers", "lm_width", "lm_heads",
                      "partition")


def prepare(logdir: str | None, export_dir: str | None) -> str:
    """The logdir (a fresh timestamped folder under the temp dir when None), created and
    probed writable; `export_dir` probed creatable. Returns the logdir."""
    logdir = logdir or fresh_logdir()
    check_writable_dir("logdir", logdir, create=True)
    if export_dir is not None:
        check_writable_dir("export_dir", export_dir, create=False)
    return logdir


def check_creatable(logdir: str | None, export_dir: str | None) -> str | None:
    """`prepare`'s checks without creating anything: each given folder is a directory or
    can be created. Returns `logdir` as given."""
    for flag, path in (("logdir", logdir), ("export_dir", export_dir)):
        if path is not None:
            check_writable_dir(flag, path, create=False)
    return logdir


def fresh_logdir() -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return os.path.join(tempfile.gettempdir(), "mgloop", stamp)


def check_writable_dir(flag: str, path: str, create: bool) -> None:
    """Refuses a path that is a file or cannot hold files; creates it if asked."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--{flag}={path} is an existing file; give a directory path")
    if not create:
        parent = path
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent.rstrip(os.sep)) or os.sep
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise ConfigError(f"--{flag}={path} cannot be created ({parent} is not a "
                              f"writable directory); give a --{flag} under a writable one")
        return
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-probe-"):
            pass
    except OSError as error:
        raise ConfigError(f"--{flag}={path} is not a writable directory "
                          f"({error.strerror or error}); give a writable --{flag}") from None


def missing_folders(logdir: str) -> list[str]:
    """The folders of `logdir` and of its parents that do not exist yet, deepest first: those
    `prepare` will create."""
    folders, path = [], os.path.abspath(logdir)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        folders.append(path)
        path = os.path.dirname(path)
    return folders


def remove_empty(folders: list[str] | None) -> None:
    """Removes `folders` (deepest first) while they are empty: what a refused run made and
    left empty goes; anything written in them keeps them."""
    for folder in folders or ():
        try:
            os.rmdir(folder)
        except OSError:  # not empty (or gone): it and its parents stay
            return


@contextlib.contextmanager
def removed_if_left_empty(logdir: str):
    """The folders of `logdir` that the body creates (validation's `prepare`) are removed
    again if it raises while they are empty: a refused run leaves no folder behind."""
    made = missing_folders(logdir)
    try:
        yield
    except BaseException:
        remove_empty(made)
        raise


def write_config(config) -> None:
    """Records the resolved settings in <logdir>/config.json (what `check_resumable` of a
    later run compares with)."""
    summaries.write_json_atomically(os.path.join(config.logdir, CONFIG_FILENAME),
                                    config.flat())


def hparams_of(config, num_towers: int) -> dict[str, bool | int | float | str]:
    """The HParams of a run of `config` on `num_towers` towers (summaries.hparams_of): every
    setting that can change a result, the method's own options apart (aggregation.describe),
    and the tower count."""
    return summaries.hparams_of(config.hparams(), aggregation.describe(config.aggregation),
                                num_towers)


def write_run_record(config, num_towers: int, command_line: list[str] | None) -> None:
    """The root run's HParams session (`hparams_of`) and the texts of the settings and of
    `command_line` (summaries.write_run_record)."""
    summaries.write_run_record(config.logdir, hparams_of(config, num_towers), config.flat(),
                               config.links, command_line)


def check_resumable(config) -> None:
    """Refuses to resume checkpoints made with other CHECKPOINT_SHAPING settings (compared
    with the logdir's config.json, the resolved settings of the run that wrote them); logs
    one line listing the other settings that differ."""
    logdir = config.logdir
    if not checkpoint_files.holds_checkpoints(os.path.join(logdir, "checkpoints")):
        return
    try:
        with open(os.path.join(logdir, CONFIG_FILENAME)) as handle:
            previous = json.load(handle)
    except (OSError, ValueError):
        return  # no record to compare: the restore itself checks the variables
    current = config.flat()
    current = json.loads(json.dumps(current))  # as config.json holds it (tuples as lists)
    for name in CHECKPOINT_SHAPING:
        if name in previous and previous[name] != current[name]:
            raise ConfigError(
                f"--{name}={current[name]!r} differs from {previous[name]!r} of the "
                f"checkpoints in --logdir={logdir}; resume with --{name}={previous[name]} "
                "or use a fresh --logdir")
    changed = [f"--{name}={value} (was {previous[name]})" for name, value in current.items()
               if name in previous and previous[name] != value]
    if changed:
        logging.info("resuming the checkpoints in --logdir=%s with settings that differ from "
                     "their run: %s", logdir, ", ".join(changed))
