"""Shared pieces of the benchmark kit: plugins, building a system, timing, medians, tables, JSON.

A "system" is one mgloop configuration (devices, aggregation, options) built in
one process (experiments/variants.py: several side by side in its process;
experiments/bench_systems.py: one per worker process of experiments/bench.py).

Timing (the second half of this module) is the same for every timing benchmark of
experiments/ (README.md lists them):

    side by side   every case runs once per round, one case at a time, in an order
                   rotated by one each round, so that machine drift and position hit
                   every case alike (`rounds`); a case is a callable in this process
                   or a fresh child process of the benchmark itself (`in_children`,
                   `run_child` / `child_reply`), so that each peak resident set and
                   each start-up is its own
    medians        each figure is the median over the rounds, beside its median
                   absolute deviation (`summarize`, `median_and_mad`)
    ratios         against a baseline case measured in the same invocation (`add_ratio`)
    output         a markdown table after the command that made it, and the rows as
                   JSON with the command, the settings and the machine (`publish`)
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # children run from here


def load_plugins(modules) -> None:
    """Imports each module of `--plugin` (e.g. one registering an aggregation method), in
    order (mgloop.aggregation.load_plugins); one that fails raises PluginError naming it and
    the error (one line)."""
    from mgloop import aggregation
    from mgloop.errors import ConfigError
    try:
        aggregation.load_plugins(list(modules))
    except ConfigError as error:
        raise PluginError(str(error)) from None


class PluginError(ValueError):
    """A --plugin module that cannot be imported; the message is one line."""


def build(model: str, global_batch: int, dataset_object=None, workers=None, device_set=None,
          **settings):
    """(trainer, iterator) for one configuration; settings are Config fields.

    `dataset_object`: an already loaded dataset of `settings["dataset"]` (default: load it).
    Several processes: `workers` (mgloop.cluster.workers.Cluster) and `device_set` (from
    devices.setup with that cluster, its server started): the trainer is wrapped in
    the cross-worker stage, takes worker 0's variables, and reads this worker's
    contiguous part of every global batch, as mgloop.train does.
    """
    from mgloop.runs.config import Config
    config = Config(model=model, global_batch_size=global_batch, train_steps=10 ** 9,
                    logdir=os.path.join("/tmp", "mgloop-bench"), **settings).validated()
    return build_config(config, dataset_object, workers, device_set)[:2]


def build_config(config, dataset_object=None, workers=None, device_set=None,
                 transform=None):
    """(trainer, iterator, dataset) for one validated Config (see `build`); `transform`
    maps the dataset of global batches before the staging's pipeline (e.g. a slow input)."""
    import tensorflow as tf  # noqa: F401  (after the caller configured devices)
    from mgloop import data, models
    from mgloop.cluster import devices
    from mgloop.data import batch_split
    from mgloop.runs import experiment
    model = config.model
    if device_set is None:
        device_set = devices.setup(devices.parse(config.devices, config.towers_per_device))
    dataset = dataset_object or data.load(config.dataset, config.seed, config.data_dir)
    trainer = experiment.build_trainer(
        config, device_set, lambda: models.get(model)(dataset.input_shape, dataset.num_classes),
        experiment.default_loss(), dataset.input_shape, workers)
    batches = dataset.train_batches(config.global_batch_size, config.seed)
    if workers is not None and workers.num_workers > 1:
        trainer.broadcast_from_chief()
        part = functools.partial(batch_split.worker_part, workers=workers.num_workers,
                                 index=workers.index)
        batches = batches.map(lambda x, y: (part(x), part(y)))
    if transform is not None:
        batches = transform(batches)
    return trainer, iter(trainer.staging.pipeline(batches)), dataset


def median_and_mad(values) -> tuple[float, float]:
    values = np.asarray(values)
    median = float(np.median(values))
    return median, float(np.median(np.abs(values - median)))


def markdown(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A markdown table; columns are (key, header, format spec)."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "|" + "---|" * len(columns)]
    for row in rows:
        cells = [format(row[k], f) if row.get(k) is not None else "–" for k, _, f in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(header: str, rows: list[dict], columns: list[tuple[str, str, str]],
           json_out: str | None = None) -> None:
    """Prints `header` and the markdown table of `rows`; writes `rows` as JSON if asked."""
    print(header)
    print(markdown(rows, columns))
    if json_out:
        with open(json_out, "w") as handle:
            json.dump(rows, handle, indent=2)


# --- Timing: side by side, rotated, medians, ratios to a baseline, JSON ---------------------

RESULT = "@@result "  # a child's reply: the last stdout line with this prefix, then JSON


def rotation(names: list, index: int) -> list:
    """`names` rotated left by `index`: round r of `rounds` starts with the r-th case."""
    shift = index % len(names) if names else 0
    return list(names[shift:]) + list(names[:shift])


def rounds(runs: dict, count: int, warmup: int = 0, log=None) -> dict[str, list]:
    """Side by side: `warmup` untimed calls of each run first (case by case), then `count`
    rounds in which every run is called once, one at a time, the order rotated by one each
    round. Returns what each call of the rounds returned, per case in round order.
    `log(round, name, value)` is called after each timed call (e.g. to print progress)."""
    names = list(runs)
    for name in names:
        for _ in range(warmup):
            runs[name]()
    out = {name: [] for name in names}
    for index in range(count):
        for name in rotation(names, index):
            out[name].append(runs[name]())
            if log is not None:
                log(index, name, out[name][-1])
    return out


def seconds(call, per: int = 1) -> float:
    """Wall seconds of `call()`, divided by `per` (e.g. the steps of one loop)."""
    began = time.perf_counter()
    call()
    return (time.perf_counter() - began) / per


def timer(call, per: int = 1):
    """A run for `rounds`: each call returns `seconds(call, per)`."""
    return lambda: seconds(call, per)


class ChildError(RuntimeError):
    """A child process of a benchmark failed, or printed no result; with its stderr's tail."""


def child_command(module: str, *args: str) -> list[str]:
    """`python -m MODULE ARGS...` with this interpreter (a benchmark starting itself as a
    child, `module` its `__spec__.name`); run from the repository root (`run_child`)."""
    return [sys.executable, "-m", module, *args]


def child_reply(payload) -> None:
    """In a child: its result, as the line `run_child` reads back."""
    print(RESULT + json.dumps(payload), flush=True)


def run_child(command: list[str], env: dict | None = None):
    """Runs `command` to its end (a fresh process) and returns its result (`child_reply`)."""
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env,
                          cwd=ROOT)
    replies = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not replies:
        raise ChildError(f"{' '.join(command)}: exit code {done.returncode}, "
                         f"{len(replies)} results:\n{done.stderr[-3000:]}")
    return json.loads(replies[-1][len(RESULT):])


def in_children(commands: dict[str, list[str]], count: int, warmup: int = 0,
                log=None) -> dict[str, list]:
    """`rounds` in which each case is one fresh child process running its command; returns
    each case's results (`child_reply`), per round."""
    return rounds({name: functools.partial(run_child, command)
                   for name, command in commands.items()}, count, warmup, log)


def summarize(samples: dict[str, list], name: str = "case") -> list[dict]:
    """One row per case of `samples` (what `rounds` returned), in order. Numbers: the row
    has their `median`, `mad` and every value (`rounds`). Dicts (a child's figures): the
    median of each numeric figure under its own key, and every dict (`rounds`)."""
    rows = []
    for case, values in samples.items():
        row = {name: case}
        if values and isinstance(values[0], dict):
            for key, first in values[0].items():
                if isinstance(first, (int, float)) and not isinstance(first, bool):
                    row[key] = float(np.median([value[key] for value in values]))
                else:
                    row[key] = first
        else:
            row["median"], row["mad"] = median_and_mad(values)
        row["rounds"] = list(values)
        rows.append(row)
    return rows


def add_ratio(rows: list[dict], key: str, baseline: str, out: str = "ratio",
              name: str = "case", inverse: bool = False) -> None:
    """row[out] = row[key] / the baseline row's (the row whose `name` is `baseline`, measured
    in the same invocation); `inverse`: baseline's / row's (e.g. a speed-up). None where
    either is missing."""
    base = next((row for row in rows if row[name] == baseline), None)
    for row in rows:
        value = row.get(key)
        reference = None if base is None else base.get(key)
        if value is None or not reference:
            row[out] = None
        else:
            row[out] = reference / value if inverse else value / reference


def machine() -> dict:
    """What the figures were measured on (read without importing TensorFlow)."""
    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "tensorflow": version("tensorflow"),
            "keras": version("keras"), "load_average": os.getloadavg(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def command_line() -> str:
    """The command that is running, as the docs quote it (`python -m experiments.ENTRY ...`)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    entry = ["-m", spec.name] if spec is not None else [os.path.relpath(sys.argv[0])]
    return "python " + shlex.join(entry + sys.argv[1:])


def write_json(path: str, payload) -> None:
    """`payload` as JSON at `path`, replaced at once (never half written)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp")
    with open(tmp, "w") as handle:
        json.dump(payload, handle, indent=2, default=str)
        handle.write("\n")
    os.replace(tmp, path)


def publish(header: str, rows: list[dict], columns: list[tuple[str, str, str]],
            json_out: str | None = None, settings: dict | None = None) -> dict:
    """Prints the command, `header` and the markdown table of `rows`; with `json_out`,
    writes {command, machine, settings, rows} there. Returns that payload."""
    payload = {"command": command_line(), "machine": machine(), "settings": settings or {},
               "rows": rows}
    print(f"command: {payload['command']}")
    if header:
        print(header)
    print(markdown(rows, columns), flush=True)
    if json_out:
        write_json(json_out, payload)
    return payload


def dispatch(argv: list[str], commands: dict):
    """Runs the command an entry was given (`python -m experiments.ENTRY COMMAND [flags]`):
    `commands` maps each name to (function(arguments after it), {flag: default for it}).
    The defaults replace the flags' own where the command line does not set them."""
    from absl import app, flags
    if len(argv) < 2 or argv[1] not in commands:
        given = f"{argv[1]!r} is not a command; " if len(argv) > 1 else ""
        raise app.UsageError(f"{given}give one of: {', '.join(commands)}")
    function, defaults = commands[argv[1]]
    for name, value in defaults.items():
        flags.FLAGS.set_default(name, value)
    return function(argv[2:])
