"""The model the method produces as one Keras file, `<export_dir>/model.keras`.

The model given is `Trainer.global_model()` (run_end.py): the template (copy 0) for a
method whose copies are equal, else the evaluation copy holding the method's model
(DiLoCo's outer parameters, local SGD's mean of the nodes' copies: runs/inference.py).

Keras's native format, so it loads with `keras.models.load_model` without mgloop
installed (the model zoo uses built-in layers only: models/__init__.py).
"""

from __future__ import annotations

import os
import tempfile

import keras

EXPORT_FILENAME = "model.keras"


def export_model(model: keras.Model, export_dir: str) -> str:
    """Saves `model` as `<export_dir>/model.keras` (Keras native format).

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
