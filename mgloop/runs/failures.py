"""Faults of a run that are not bad settings: a full disk, a non-finite loss.

Each is raised as an error whose message is one line naming the path or the
step and how to resume; `python -m mgloop.train` prints that line and exits 1.
The last complete checkpoint is never replaced by a failed or non-finite save.
"""

from __future__ import annotations

import errno
import re

import tensorflow as tf

_NO_SPACE = "No space left on device"
# TensorFlow's message: "{{function_node ...}} <path>; No space left on device [Op:SaveV2]"
_TF_PATH = re.compile(r"(?:\}\}\s*)?([^\s;{}][^;{}]*?);\s*" + _NO_SPACE)


class RunFailed(RuntimeError):
    """A run stopped by a fault; the message is one line saying what and how to resume."""


class DiskFull(RunFailed):
    """The device of an output (checkpoint, summary) is full."""


class NonFinite(RunFailed, FloatingPointError):
    """The loss or a variable became NaN or infinite; no checkpoint holds it."""


def disk_full_path(error: BaseException) -> str | None:
    """The path whose write failed if `error` says its device is full (ENOSPC), "" if
    the error does not name it, else None.

    Python's OSError carries errno ENOSPC and the file name; TensorFlow's
    ResourceExhaustedError (also the type of an out-of-memory error, told apart
    by its text) names the file before "; No space left on device".
    """
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return error.filename or ""
    if isinstance(error, tf.errors.OpError) and _NO_SPACE in str(error):
        match = _TF_PATH.search(str(error))
        return match.group(1).strip() if match else ""
    return None
