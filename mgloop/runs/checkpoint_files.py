"""The checkpoints folder as files: which checkpoints it holds, which is damaged, its
state file, and what an interrupted save left behind.

Checkpoint N is the files `ckpt-N.index` and `ckpt-N.data-*` (N = global step) in
`<logdir>/checkpoints`; TensorFlow's state file `checkpoints/checkpoint` names the
latest and those kept. Read and tidied by the Checkpointer (checkpoint.py), which
decides what to restore; run_dir.py asks whether a logdir holds checkpoints to resume.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import uuid

from absl import logging
from google.protobuf import text_format
import tensorflow as tf
from tensorflow.python.training import checkpoint_state_pb2

from mgloop.errors import one_line

STATE_FILENAME = "checkpoint"  # TensorFlow's state file: which checkpoints exist, the latest
DAMAGED_SUFFIX = ".damaged"
INCOMPLETE_SUFFIX = ".incomplete"  # a checkpoint without every node's part (node_checkpoint.py)
_INDEX = re.compile(r"ckpt-(\d+)\.index")
_LEFTOVER = re.compile(r"ckpt-\d+_temp|checkpoint\.tmp[0-9a-f]+")  # of an interrupted save
_DATA = re.compile(r"(ckpt-\d+)\.data-\d+-of-\d+")


def checkpoint_steps(directory: str) -> list[int]:
    """Steps of the checkpoints in `directory` that have an index file, newest first."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted((int(m.group(1)) for m in map(_INDEX.fullmatch, names) if m), reverse=True)


def holds_checkpoints(directory: str) -> bool:
    """Whether `directory` holds a checkpoint or a state file naming one."""
    return bool(checkpoint_steps(directory)) or os.path.exists(
        os.path.join(directory, STATE_FILENAME))


def damage(prefix: str) -> str | None:
    """Reads every tensor of the checkpoint at `prefix`; returns "<file>: <what failed>"
    for the first file that does not read back intact, or None."""
    name = os.path.basename(prefix)
    data_files = sorted(glob.glob(glob.escape(prefix) + ".data-*"))
    try:
        reader = tf.train.load_checkpoint(prefix)
    except Exception as error:  # noqa: BLE001 - any failure to open is damage
        return f"{name}.index: {one_line(error)}"
    try:
        for key in reader.get_variable_to_dtype_map():
            reader.get_tensor(key)
    except Exception as error:  # noqa: BLE001 - any failure to read is damage
        named = re.search(re.escape(name) + r"\.data-\d+-of-\d+", str(error))  # a missing one
        where = named.group(0) if named else ", ".join(
            os.path.basename(f) for f in data_files) or f"{name}.data-*"
        return f"{where}: {one_line(error)}"
    return None


def set_aside(prefix: str, suffix: str = DAMAGED_SUFFIX) -> None:
    """Renames the files of the damaged (or incomplete) checkpoint at `prefix` to
    `*<suffix>` (kept for inspection, no longer a checkpoint of the folder)."""
    for name in glob.glob(glob.escape(prefix) + ".*"):
        if not name.endswith((DAMAGED_SUFFIX, INCOMPLETE_SUFFIX)):
            os.replace(name, name + suffix)


def read_state(directory: str):
    """(the state file's CheckpointState or None, what is wrong with it or None)."""
    path = os.path.join(directory, STATE_FILENAME)
    if not os.path.exists(path):
        return None, "is missing"
    state = checkpoint_state_pb2.CheckpointState()
    try:
        with open(path) as handle:
            text_format.Merge(handle.read(), state)
    except (OSError, UnicodeDecodeError, text_format.ParseError) as error:
        return None, f"is unreadable ({one_line(error)})"
    if not state.model_checkpoint_path:
        return None, "names no checkpoint"
    return state, None


def write_state(directory: str, latest: str) -> None:
    """Atomically, the state file naming `latest` and the checkpoints up to it (their
    index files' times as save times, so that the manager deletes the oldest beyond
    `keep` as it would have)."""
    latest_step = int(latest.rsplit("-", 1)[1])
    names = [f"ckpt-{step}" for step in sorted(checkpoint_steps(directory))
             if step <= latest_step]
    state = checkpoint_state_pb2.CheckpointState(
        model_checkpoint_path=os.path.basename(latest), all_model_checkpoint_paths=names,
        all_model_checkpoint_timestamps=[
            os.path.getmtime(os.path.join(directory, n + ".index")) for n in names])
    path = os.path.join(directory, STATE_FILENAME)
    temporary = f"{path}.tmp{uuid.uuid4().hex}"  # removed as a leftover if killed here
    with open(temporary, "w") as handle:
        handle.write(text_format.MessageToString(state))
    os.replace(temporary, path)


def remove_leftovers(directory: str) -> None:
    """Removes what a save killed midway left: `ckpt-N_temp/`, `checkpoint.tmp*`, and data
    files whose index was never written; one log line names them."""
    if not os.path.isdir(directory):
        return
    names = set(os.listdir(directory))
    leftovers = sorted(n for n in names if _LEFTOVER.fullmatch(n) or (  # data, no index yet
        _DATA.fullmatch(n) and f"{_DATA.fullmatch(n).group(1)}.index" not in names))
    for name in leftovers:
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)
    if leftovers:
        logging.info("removed what an interrupted save left in %s: %s", directory,
                     ", ".join(leftovers))
