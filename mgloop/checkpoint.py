"""Checkpoints of the template model and its optimizer, and the model export.

A checkpoint holds variable copy 0 only (the template model, copy 0's
optimizer slots, the global step), so it does not depend on the tower count or
the layout: a run saved with `ps_cpu` on 1 device resumes as `ring` on 4.
After a restore the trainer copies copy 0 into every other replica.
TensorFlow writes a checkpoint's data before the index file that names it, so
an interrupted save never becomes the latest checkpoint.
"""

from __future__ import annotations

import os
import tempfile

import keras
import tensorflow as tf

from mgloop.errors import ConfigError

EXPORT_FILENAME = "model.keras"


class Checkpointer:
    """Saves every so often into `<logdir>/checkpoints`, keeping the last `keep`."""

    def __init__(self, directory: str, model: keras.Model, optimizer, step: tf.Variable,
                 keep: int):
        self._directory = directory
        self._checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, step=step)
        self._manager = tf.train.CheckpointManager(self._checkpoint, directory, max_to_keep=keep)

    @property
    def latest(self) -> str | None:
        return self._manager.latest_checkpoint

    def restore_latest(self) -> str | None:
        """Restores the newest checkpoint, if any; returns its path."""
        path = self._manager.latest_checkpoint
        if path is None:
            return None
        status = None
        try:
            status = self._checkpoint.restore(path)
            status.assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.OpError) as error:
            if status is not None:
                status.expect_partial()  # the error below says it all; no warnings at exit
            raise ConfigError(
                f"--logdir={os.path.dirname(os.path.dirname(path))}: checkpoint {path} does not match this model and optimizer "
                f"({str(error).splitlines()[0]}); use a fresh --logdir") from None
        return path

    def save(self, step: int) -> str:
        """Saves; refuses (FileNotFoundError) if the folder holding `directory` is gone
        (TensorFlow would silently recreate a deleted logdir)."""
        parent = os.path.dirname(os.path.normpath(self._directory))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"{parent} is gone")
        return self._manager.save(checkpoint_number=step)


def export_model(model: keras.Model, export_dir: str) -> str:
    """Saves the template model as `<export_dir>/model.keras` (Keras native format).

    The file is written under a temporary name and renamed, so a crash leaves
    either the previous export or the new one, never half of one.
    """
    os.makedirs(export_dir, exist_ok=True)
    path = os.path.join(export_dir, EXPORT_FILENAME)
    fd, tmp = tempfile.mkstemp(dir=export_dir, prefix=".tmp-", suffix=".keras")
    os.close(fd)
    try:
        model.save(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path
