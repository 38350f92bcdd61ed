"""TensorBoard writers and the run's `summary.json`.

Layout of a logdir (tags are stable; docs/tensorboard.md lists them):

    <logdir>/train/   events: loss, accuracy, learning_rate, examples_per_sec, step_time,
                      input_wait (seconds per step the towers waited for input);
                      at the end: traffic/<DEVICE>/sent_bytes, traffic/<DEVICE>/received_bytes
                      (per step averaged over the run's steps, e.g. traffic/CPU_1/sent_bytes)
                      and exchange_seconds, and the link report's (link_scalars.py):
                      link/bytes_per_device, link/gradient_bytes_per_step,
                      link/state_bytes_per_step, link/compression_ratio (gradients),
                      link/compute_seconds (of --compute: observe/hardware.py),
                      link/measured_compute_seconds, link/flops_per_example (a
                      profile's), link/<LINK>/exchange_seconds,
                      .../exchange_seconds_slowest_step, .../step_seconds_no_overlap,
                      .../step_seconds_overlap per --link (e.g. LINK 10gbit_10us)
    <logdir>/eval/    events: loss, accuracy (held-out split, every --eval_every steps, end)
    <logdir>/         events of the root run: HParams session, text config and command_line,
                      final/train_loss, final/eval_accuracy, final/examples_per_sec,
                      final/bytes_per_device, final/gradient_bytes_per_step,
                      final/compression_ratio, final/compute_seconds,
                      final/link/<LINK>/..., the text link/compute_source
    <logdir>/summary.json

Diagnostic tags (tower_i/..., grad/..., replica/divergence, loss_scale, memory/...,
histograms) are listed in diagnostics.py and monitor.py.

Train scalars are means over the steps since the previous summary. `accuracy`
(train, eval, final/eval_accuracy) is written only where the loss defines one
(accuracy.py); summary.json then holds null.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Callable

import numpy as np
import tensorflow as tf
from tensorboard.plugins.hparams import api as hparams_api

from mgloop.observe import link_scalars

# The metrics of the HParams table (root-run scalars), with the link model's
# (`final_metric_tags`); its hyperparameters: `hparams_of`.
FINAL_METRICS = ("final/train_loss", "final/eval_accuracy", "final/examples_per_sec")


def final_metric_tags(links: tuple[str, ...]) -> tuple[str, ...]:
    """FINAL_METRICS and the link model's final metrics for the run's --link values."""
    return FINAL_METRICS + link_scalars.final_metric_tags(links)


class ScalarWriter:
    """Writes dicts of Python floats as scalars of one run folder (`train`, `eval`).

    A set of tags written again is written by one compiled function (traced at its
    second write) that takes the values as one float32 vector and writes
    `tf.summary.scalar(tag_i, v[i])` for every tag, then flushes: one op call per window.
    Its first write is eager (a few ops per tag): a set written once, as the final
    scalars of a run, costs no trace (about 0.15 s of CPU). The step and the values reach
    it as numpy values, never Python scalars: TensorFlow keeps the tensor of every
    distinct Python scalar it converts (its eager scalar cache, never evicted), so a
    Python-int step, new at every window, kept about 1.5 KiB per window of 7 eager
    scalars (experiments/memory.py summary_writes, docs/results/long-runs.md).
    """

    def __init__(self, logdir: str, run: str):
        self._folder = os.path.join(logdir, run)
        self._writer = tf.summary.create_file_writer(self._folder)
        self._compiled: dict[tuple, Callable] = {}  # by what a write writes (its key)
        self._written_once: set[tuple] = set()

    def _eager_then_compiled(self, key: tuple, write: Callable, signature: list) -> Callable:
        """`write(step, values)` of the set `key` names: eager the first time it is asked
        for, compiled with `signature` from the second (the class docstring)."""
        if key in self._compiled:
            return self._compiled[key]
        if key not in self._written_once:
            self._written_once.add(key)
            return write
        self._compiled[key] = tf.function(write, autograph=False, input_signature=signature)
        return self._compiled[key]

    def _write(self, tags: tuple[str, ...]) -> Callable:
        """The write of `tags`: (step int64, values float32[len(tags)])."""
        writer = self._writer

        def write(step, values):  # numpy values when eager: no cached tensor
            with writer.as_default(step=step):
                for index, tag in enumerate(tags):
                    tf.summary.scalar(tag, values[index])
            writer.flush()

        return self._eager_then_compiled(tags, write, [
            tf.TensorSpec([], tf.int64), tf.TensorSpec([len(tags)], tf.float32)])

    def _check_folder(self) -> None:
        """TensorFlow would write on into deleted files (or recreate folders) silently."""
        if not os.path.isdir(self._folder):
            raise FileNotFoundError(f"the summary folder {self._folder} is gone")

    def scalars(self, step: int, values: dict[str, float | None]) -> None:
        """Writes every value but None (not measured: e.g. the speed of a window holding
        only the run's first, traced, step)."""
        self._check_folder()
        values = {tag: value for tag, value in values.items() if value is not None}
        if not values:
            return
        tags = tuple(values)
        # numpy first: TensorFlow caches the tensor of every distinct Python scalar it
        # converts (about 0.7 KiB per new step number), a numpy array it does not
        self._write(tags)(np.asarray(step, np.int64),
                                   np.asarray([values[t] for t in tags], np.float32))

    def histograms(self, step: int, values: dict[str, np.ndarray]) -> None:
        """Writes each array as a histogram; as the scalars, eager the first time a set of
        tags (with its shapes and dtypes) is written, compiled from the second: one op call
        a write instead of a few eager ops per tag (a tenth of the CPU for the mlp's 12
        tags: `python -m experiments.histogram_writes`)."""
        self._check_folder()
        arrays = [np.asarray(value) for value in values.values()]
        key = tuple((tag, array.shape, array.dtype.str) for tag, array in zip(values, arrays))
        self._histogram_write(key)(np.asarray(step, np.int64), arrays)

    def _histogram_write(self, key: tuple) -> Callable:
        """The write of `key`'s (tag, shape, dtype) histograms: (step int64, [arrays])."""
        writer, tags = self._writer, [tag for tag, _, _ in key]

        def write(step, arrays):
            with writer.as_default(step=step):
                for tag, array in zip(tags, arrays):
                    tf.summary.histogram(tag, array)
            writer.flush()

        return self._eager_then_compiled(key, write, [
            tf.TensorSpec([], tf.int64),
            [tf.TensorSpec(shape, np.dtype(dtype)) for _, shape, dtype in key]])

    def close(self) -> None:
        self._writer.close()


class NullWriter:
    """A writer that writes nothing: what workers other than the chief get."""

    def __init__(self, logdir: str = "", run: str = ""):
        pass

    def scalars(self, step, values) -> None:
        pass

    def histograms(self, step, values) -> None:
        pass

    def close(self) -> None:
        pass


def hparams_of(settings: dict, method: dict,
               num_towers: int) -> dict[str, bool | int | float | str]:
    """The hyperparameters of a run's HParams session: `settings`, every setting that can
    change a result by name (the validated Config's `hparams()`: its fields marked
    `hparam=True`, settings.py), the tower count and `method`, the aggregation method by
    its name and its own options, one hparam per option, defaults included (e.g.
    "aggregation/shards": aggregation.describe). A tuple (--plugin) is recorded as one
    comma-separated string; a None (a setting of another model or dataset, e.g.
    --lm_layers) is left out."""
    values = {}
    for name, value in settings.items():
        if value is None:
            continue
        values[name] = ",".join(value) if isinstance(value, (tuple, list)) else value
    values["num_towers"] = num_towers
    values.update(method)
    return values


def write_run_record(logdir: str, hparams: dict, settings: dict, links: tuple[str, ...],
                     command_line: list[str] | None) -> None:
    """Root run of `logdir`: the HParams session start (`hparams`, from `hparams_of`: the
    hyperparameters of the table; its metrics `final_metric_tags` of the --link values
    `links`) and the texts `config` (every setting by name, resolved: JSON) and
    `command_line`."""
    writer = tf.summary.create_file_writer(logdir)
    with writer.as_default(step=0):
        hparams_api.hparams_config(
            hparams=[hparams_api.HParam(name) for name in hparams],
            metrics=[hparams_api.Metric(tag) for tag in final_metric_tags(links)])
        hparams_api.hparams(hparams, trial_id=os.path.basename(os.path.normpath(logdir)))
        tf.summary.text("config", "```\n" + json.dumps(settings, indent=2,
                                                       sort_keys=True) + "\n```")
        if command_line is not None:
            tf.summary.text("command_line", "`" + " ".join(command_line) + "`")
    writer.close()


def write_final_metrics(logdir: str, step: int, values: dict[str, float | None],
                        texts: dict[str, str] | None = None) -> None:
    """The HParams table's metrics (`final_metric_tags`), as scalars of the root run; a
    None value is not written; `texts`, text summaries of the root run beside them."""
    writer = tf.summary.create_file_writer(logdir)
    with writer.as_default(step=step):
        for tag in values:
            if values[tag] is not None:
                tf.summary.scalar(tag, values[tag])
        for tag, text in (texts or {}).items():
            tf.summary.text(tag, text)
    writer.close()


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
