"""TensorBoard writers and the run's `summary.json`.

Layout of a logdir (tags are stable; the README lists them):

    <logdir>/train/   events: loss, accuracy, learning_rate, examples_per_sec, step_time,
                      input_wait (seconds per step the towers waited for input);
                      at the end: traffic/<DEVICE>/sent_bytes, traffic/<DEVICE>/received_bytes
                      (per step, e.g. traffic/CPU_1/sent_bytes) and exchange_seconds
    <logdir>/eval/    events: loss, accuracy (held-out split, at the end of training)
    <logdir>/summary.json

Train scalars are means over the steps since the previous summary.
"""

from __future__ import annotations

import json
import os
import tempfile

import tensorflow as tf


class ScalarWriter:
    """Writes dicts of Python floats as scalars of one run folder (`train`, `eval`)."""

    def __init__(self, logdir: str, run: str):
        self._writer = tf.summary.create_file_writer(os.path.join(logdir, run))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        with self._writer.as_default(step=step):
            for tag, value in values.items():
                tf.summary.scalar(tag, value)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def aggregation_scalars(traffic: dict[str, dict[str, int]],
                        exchange_seconds: float | None) -> dict[str, float]:
    """Scalars of what the aggregation costs: bytes per device per step, exchange time."""
    values = {}
    for device, counts in traffic.items():
        name = device.replace(":", "_")
        values[f"traffic/{name}/sent_bytes"] = float(counts["sent"])
        values[f"traffic/{name}/received_bytes"] = float(counts["received"])
    if exchange_seconds is not None:
        values["exchange_seconds"] = exchange_seconds
    return values


def write_json_atomically(path: str, payload: dict) -> None:
    """Writes JSON to a temporary file beside `path`, then renames it into place."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle, indent=2, sort_keys=True)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
