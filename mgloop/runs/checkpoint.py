"""Checkpoints of the template model and its optimizer (the export: export.py).

A checkpoint holds variable copy 0 only (the template model, copy 0's
optimizer slots, the global step), so it does not depend on the tower count or
the layout: a run saved with `ps_cpu` on 1 device resumes as `ring` on 4.
After a restore the trainer copies copy 0 into every other replica. Copy 0 is the main
weights even where it is not the model the method produces (DiLoCo's outer parameters, local
SGD's mean: runs/inference.py): that model is rebuilt from what the checkpoint holds (every
copy and the method's state, below), so a resume stays bit-exact; the export is that model. It also
holds the aggregation method's state (`Aggregation.state_variables`: residuals,
counters), under `aggregation_state/<method name>/`: restored when the checkpoint
holds the same method's state, left as `build` made it (a log line says so) when
it holds none (a run resumed with another method; its state then starts afresh).
A method whose copies differ between its synchronisations (`copies_differ`: local
SGD, DiLoCo) also has every other copy and its optimizer saved, under `replicas/`,
and restored (`restored_every_copy`), so a run resumed mid-period continues as the
uninterrupted one; such a checkpoint resumes with the same tower count only.
With --shard_update each copy holds the optimizer state of its chunk alone; a save
gathers it into one whole optimizer and a restore scatters from one (the replicas'
update's `whole_optimizer`), so the checkpoint is the same as without it.
TensorFlow writes a checkpoint's data before the index file that names it, so
an interrupted save never becomes the latest checkpoint.

Checkpoint N is the files `ckpt-N.index` and `ckpt-N.data-*` (N = global step)
in `<logdir>/checkpoints` (checkpoint_files.py reads and tidies the folder's files).
A resume does not trust the state file
`checkpoints/checkpoint` alone: it restores the newest checkpoint of the folder
that is intact, reading every tensor first (TensorFlow checks each tensor's
stored CRC32C), so damage (a truncated, emptied or overwritten file, flipped
bits) is told apart from a checkpoint of another model:

- damage: the damaged checkpoint's files are renamed `*.damaged` (kept for
  inspection), one warning names them, and the run resumes from the newest
  intact checkpoint; if none is intact the run is refused (ConfigError), never
  started from step 0;
- a checkpoint that reads cleanly but does not fit the model: refused;
- an unreadable or missing state file is rebuilt from the folder;
- leftovers of a save killed midway (`ckpt-N_temp/`, `checkpoint.tmp*`, data files
  whose index was never written) are removed.

A save refuses non-finite variables (failures.NonFinite) and turns a full disk
into failures.DiskFull; either way the previous checkpoint stays the latest.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import shutil

from absl import logging
import keras
import numpy as np
import tensorflow as tf

from mgloop.errors import ConfigError
from mgloop.runs import checkpoint_files
from mgloop.runs import failures
from mgloop.training.variables import backing


def _forget_glob_patterns() -> None:
    """Empties `fnmatch`'s cache of compiled patterns (32,768 entries, ~0.6 KiB each).

    TensorFlow measures every checkpoint it writes with `glob.glob("<prefix>*")`
    (checkpoint.py, `_get_checkpoint_size`), and each prefix (`ckpt-<step>`) is a new
    pattern, so a run kept one compiled pattern per save until the cache was full:
    ~20 MiB after 32,768 checkpoints. `re`'s own cache of 512 stays.
    """
    clear = getattr(getattr(fnmatch, "_compile_pattern", None), "cache_clear", None)
    if clear is not None:  # a private name: if a Python lacks it, nothing is lost but memory
        clear()


class Checkpointer:
    """Saves every so often into `<logdir>/checkpoints`, keeping the last `keep`."""

    def __init__(self, directory: str, model: keras.Model, optimizer, step: tf.Variable,
                 keep: int, aggregation=None, copies=(), update=None):
        """`update`: how the replicas update (step/replicas.py `WholeUpdate`, or a
        sharded_update.ShardedUpdate), whose `whole_optimizer` is saved and restored in
        place of `optimizer`; None: `optimizer` as it is."""
        self._directory = directory
        self._keep = keep
        self._update = update
        self._core = dict(model=model, optimizer=optimizer, step=step)
        self._extras = {}  # checkpoint key prefix -> (name, holder), restored only if saved
        state = list(aggregation.state_variables) if aggregation is not None else []
        if state:
            holder = tf.Module()
            setattr(holder, aggregation.name, state)
            self._extras[f"aggregation_state/{aggregation.name}/"] = ("aggregation_state",
                                                                     holder)
        # copies besides copy 0 that differ from it (Replicas.checkpointed_copies: local SGD)
        replicas = [[*c.variables, *(backing(v) for v in c.optimizer.variables)]
                    for c in copies]
        if replicas:
            holder = tf.Module()
            holder.copies = replicas
            self._extras["replicas/"] = ("replicas", holder)
        self._checkpoint = tf.train.Checkpoint(
            **self._core, **{name: holder for name, holder in self._extras.values()})
        self.restored_every_copy = False  # the last restore set copies 1.. too
        optimizer_variables = (update.optimizer_variables if update is not None
                               else optimizer.variables)
        self._variables = [v for v in [*model.variables, *optimizer_variables, *state,
                                       *(v for vs in replicas for v in vs)]
                           if tf.as_dtype(v.dtype).is_floating]
        self._all_finite = None  # made at the first save (_check_finite)
        self._manager_instance = None  # built once the state file is known to be readable

    @classmethod
    def of_trainer(cls, directory: str, trainer, keep: int) -> "Checkpointer":
        """What a run checkpoints of its Trainer: the template model, copy 0's optimizer,
        the step, the method's state and the copies that differ from copy 0."""
        return cls(directory, trainer.model, trainer.copies[0].optimizer, trainer.global_step,
                   keep=keep, aggregation=trainer.aggregation,
                   copies=trainer.replicas.checkpointed_copies, update=trainer.replicas.update)

    @contextlib.contextmanager
    def _with_optimizer(self, checkpoint: tf.train.Checkpoint, restoring: bool):
        """`checkpoint` holding the update's whole optimizer for this one save or restore
        (copy 0's; with a sharded update, gathered before or scattered after), then copy
        0's again."""
        if self._update is None:
            yield
            return
        with self._update.whole_optimizer(restoring) as whole:
            checkpoint.optimizer = whole
            try:
                yield
            finally:
                checkpoint.optimizer = self._core["optimizer"]

    @property
    def _manager(self) -> tf.train.CheckpointManager:
        if self._manager_instance is None:
            self._manager_instance = tf.train.CheckpointManager(
                self._checkpoint, self._directory, max_to_keep=self._keep)
        return self._manager_instance

    @property
    def latest(self) -> str | None:
        return self._manager.latest_checkpoint

    def restore_latest(self, tidy: bool = True, incomplete=None) -> str | None:
        """Restores the newest intact checkpoint, if any; returns its path.

        `tidy` (the chief only, as it alone writes): removes leftovers of an
        interrupted save, renames damaged checkpoints aside and rewrites the
        state file when it is unreadable or names anything else. `incomplete(step)`:
        why checkpoint `step` lacks a node's part (node_checkpoint.py), or None; such a
        checkpoint is skipped (renamed `*.incomplete` when tidying) for an older one.
        """
        if tidy:
            checkpoint_files.remove_leftovers(self._directory)
        state, state_problem = checkpoint_files.read_state(self._directory)
        damaged = []
        for step in checkpoint_files.checkpoint_steps(self._directory):
            prefix = os.path.join(self._directory, f"ckpt-{step}")
            missing = incomplete(step) if incomplete is not None else None
            if missing is not None:
                logging.warning("skipped checkpoint %s: %s (a worker ended before its "
                                "save)", prefix, missing)
                if tidy:
                    checkpoint_files.set_aside(prefix, checkpoint_files.INCOMPLETE_SUFFIX)
                continue
            problem = checkpoint_files.damage(prefix)
            if problem is None:
                break
            damaged.append((prefix, problem))
        else:
            prefix = None
        logdir = os.path.dirname(os.path.normpath(self._directory))
        if prefix is None and damaged:
            raise ConfigError(
                f"--logdir={logdir}: no checkpoint in {self._directory} is intact ("
                + "; ".join(problem for _, problem in damaged) + "); restore one from a "
                "backup, or move the checkpoints folder away to start again from step 0")
        if prefix is None and state is not None and state.model_checkpoint_path:
            raise ConfigError(
                f"--logdir={logdir}: the state file "
                f"{self._directory}/{checkpoint_files.STATE_FILENAME} names "
                f"{state.model_checkpoint_path}, but no checkpoint files are in the folder; "
                "restore them, or move the checkpoints folder away to start again from step 0")
        if prefix is not None:
            self._restore(prefix, logdir)
        if damaged:
            if tidy:
                for path, _ in damaged:
                    checkpoint_files.set_aside(path)
            logging.warning(
                "skipped damaged checkpoint%s in %s: %s%s; resuming from %s, the newest intact "
                "one", "s" if len(damaged) > 1 else "", self._directory,
                "; ".join(problem for _, problem in damaged),
                f" (kept as *{checkpoint_files.DAMAGED_SUFFIX})" if tidy else "",
                os.path.basename(prefix))
        if tidy:
            self._record(prefix, state, state_problem)
        return prefix

    def _record(self, restored: str | None, state, state_problem: str | None) -> None:
        """Makes the state file name `restored` (and the checkpoints before it) if it
        names anything else or is unreadable; removes one that names nothing."""
        path = os.path.join(self._directory, checkpoint_files.STATE_FILENAME)
        if restored is None:
            if state_problem and os.path.exists(path):
                os.remove(path)  # names no checkpoint: the first save writes a new one
            return
        if state is not None and (os.path.basename(state.model_checkpoint_path)
                                  == os.path.basename(restored)):
            return
        checkpoint_files.write_state(self._directory, restored)
        self._manager_instance = None  # reads the new state file when next used
        if state_problem:
            logging.warning("the checkpoint state file %s %s; rebuilt it from the checkpoints "
                            "in the folder", path, state_problem)

    def _restore(self, prefix: str, logdir: str) -> None:
        status = None
        names = [name for name, _ in tf.train.list_variables(prefix)]
        present = {}
        for key, (attribute, holder) in self._extras.items():
            if any(name.startswith(key) for name in names):
                present[attribute] = holder
            elif attribute == "replicas":
                logging.info("checkpoint %s holds copy 0 alone: every copy restarts from it",
                             prefix)
            else:
                logging.info("checkpoint %s holds no state of the aggregation method "
                             "(%s...): its state starts as the method builds it", prefix, key)
        checkpoint = (self._checkpoint if len(present) == len(self._extras)
                      else tf.train.Checkpoint(**self._core, **present))
        self.restored_every_copy = "replicas" in present
        try:
            with self._with_optimizer(checkpoint, restoring=True):
                status = checkpoint.restore(prefix)
                status.assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.OpError) as error:
            if status is not None:
                status.expect_partial()  # the error below says it all; no warnings at exit
            raise ConfigError(
                f"--logdir={logdir}: checkpoint {prefix} is intact but does not match this "
                f"model and optimizer ({str(error).splitlines()[0]}); resume with the model "
                "and optimizer that wrote it, or use a fresh --logdir") from None

    def save(self, step: int) -> str:
        """Saves; refuses (FileNotFoundError) if the folder holding `directory` is gone
        (TensorFlow would silently recreate a deleted logdir), non-finite variables
        (failures.NonFinite) and a full disk (failures.DiskFull)."""
        parent = os.path.dirname(os.path.normpath(self._directory))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"{parent} is gone")
        self._check_finite(step)
        try:
            with self._with_optimizer(self._checkpoint, restoring=False):
                return self._manager.save(checkpoint_number=step)
        except (tf.errors.OpError, OSError) as error:
            path = failures.disk_full_path(error)
            if path is None:
                raise
            shutil.rmtree(os.path.join(self._directory, f"ckpt-{step}_temp"), ignore_errors=True)
            raise failures.DiskFull(
                f"no space left on the device of {path} while saving the checkpoint of step "
                f"{step}; the last complete checkpoint ({self.latest or 'none yet'}) is kept: "
                "free space, then rerun the same command to resume") from None
        finally:
            _forget_glob_patterns()

    def _check_finite(self, step: int) -> None:
        """Refuses a save of NaN/inf values: a reduction on the variables' own devices (no
        host copy of the model per save), eager at the first save (two ops a variable: a
        run that saves once traces nothing, about 0.15 s of CPU), compiled from the second;
        the first offending variable is looked up only when there is one."""
        if not self._variables:
            return
        if self._all_finite is None:
            variables = self._variables

            def all_finite():
                return tf.reduce_all(tf.stack(
                    [tf.reduce_all(tf.math.is_finite(v)) for v in variables]))
            finite = bool(all_finite())
            self._all_finite = tf.function(all_finite, autograph=False)
        else:
            finite = bool(self._all_finite())
        if finite:
            return
        variable = next(v for v in self._variables if not np.isfinite(v.numpy()).all())
        name = getattr(variable, "path", variable.name)  # a method's tf.Variable has no path
        raise failures.NonFinite(
            f"{name} holds NaN or inf at step {step}, so its checkpoint is "
            f"not written; the last checkpoint ({self.latest or 'none yet'}) is finite: "
            "rerun with the same --logdir and a lower --learning_rate to resume from it")
