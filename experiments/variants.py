"""Variants of one mgloop configuration side by side, in one process: a table, JSON, HParams.

    python -m experiments.variants --vary aggregation=ps_cpu,ring --vary pack_bytes=0,65536 \
        --set devices=cpu:4 --repeats=9 --steps=50 --measure=exchange,traffic \
        --output_dir=/tmp/variants
    tensorboard --logdir=/tmp/variants/tensorboard     (HParams tab: one session per variant)

Keys are Config fields (mgloop/runs/sweep/grid.py: `--vary KEY=V1,V2`, tied
keys `--vary K1/K2=A/B,C/D`, `--set KEY=VALUE`); the variants are the cross
product of the --vary axes, the first the baseline of the ratios (with
`--group=model`, the first variant of each model is its group's baseline).
`--plugin=MODULE` (repeatable) imports a module first, e.g. one registering an
aggregation method that a variant then names.

Each variant is validated (one line per refusal, before anything is built;
`--skip_invalid` skips refused combinations instead and lists them), then
built once in this process on the same logical devices (`--copies=2`: twice,
in the order v1..vn, vn..v1, since the build order alone moves a small
model's step by several percent). Each timed repeat is one compiled loop of
`--steps` steps; after `--warmup` untimed loops each, `--repeats` rounds run
every build once, the order rotated by one each round, so that machine drift
and position hit every variant alike (experiments/benchlib.py's rounds, as every
timing benchmark of the kit).

Reported per variant: median examples/sec over the timed loops with its
median absolute deviation (propagated from the step time's), the median step,
its ratio to the baseline's median step, the mean loss of the last loop (the
variants start from the same weights and data, so an exact method's losses
agree), and the `--measure` columns (experiments/variants_measure.py); with
`--link=BANDWIDTH,LATENCY` (repeatable) the link model of each variant's counted
traffic (bytes per device, compression ratio to the baseline, compute, modelled
exchange and step per link; mgloop/observe/link_model.py). The compression table of
docs/results/methods.md: `--flagfile=experiments/variants_flags/compression_ablation.flags`. With
`--copies=2` also the median over rounds of (variant's builds) / (baseline's
builds) with its standard error, and the A/A control of the variant's two
builds, the noise floor of the moment. Outputs in --output_dir: variants.md,
variants.json, tensorboard/ (one run per variant: as hparams what a training
run records, every setting that can change a result; the figures as scalars).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time

from absl import app, flags, logging
import numpy as np

from experiments import benchlib
from experiments import variants_measure as measure_lib
from experiments import variants_report
from mgloop.runs.sweep import grid as variants_spec

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_FLAGS = flags.FLAGS
flags.DEFINE_multi_string("vary", [], "KEY=V1,V2,... (a Config field and its values; K1/K2="
                          "A1/B1,A2/B2 ties keys); repeatable: the variants are the cross product")
flags.DEFINE_multi_string("set", [], "KEY=VALUE: a Config setting of every variant; repeatable")
flags.DEFINE_multi_string("link", [], "BANDWIDTH,LATENCY, e.g. 10gbit,10us (repeatable): the "
                          "link model of each variant's counted traffic (bytes per device, "
                          "compression ratio, compute, modelled exchange and step per link; "
                          "measures the exchange alone)")
flags.DEFINE_multi_string("plugin", [], "a module to import first (e.g. one registering an "
                          "aggregation method); repeatable")
flags.DEFINE_list("measure", [], f"extra measurements: {', '.join(measure_lib.MEASURES)}")
flags.DEFINE_list("group", [], "keys whose values share a baseline: the first variant of "
                  "each group (e.g. model)")
flags.DEFINE_integer("steps", 20, "steps per timed loop")
flags.DEFINE_integer("warmup", 2, "untimed loops per build before timing")
flags.DEFINE_integer("repeats", 7, "timed loops per build, interleaved (rotating order)")
flags.DEFINE_integer("copies", 1, "builds per variant (2: built v1..vn, vn..v1; paired ratios "
                     "and an A/A control)")
flags.DEFINE_string("input_delay_ms", None, "per-batch host delay of the input (a slow "
                    "input); auto: t_input = t_compute (needs --measure=ideal)")
flags.DEFINE_bool("skip_invalid", False, "skip variants the Config refuses (listed) instead "
                  "of stopping")
flags.DEFINE_string("output_dir", None, "variants.md, variants.json, tensorboard/ (default: a "
                    "fresh folder under the temp dir)")


class UsageError(ValueError):
    """A setting of the harness itself it cannot run; one line."""


@dataclasses.dataclass
class Build:
    """One build of a variant: its trainer and the iterator it reads."""

    variant: variants_spec.Variant
    copy: int
    config: object
    trainer: object
    iterator: object
    dataset: object
    times: list = dataclasses.field(default_factory=list)  # seconds per step, per timed loop
    waits: list = dataclasses.field(default_factory=list)  # input wait per step, per timed loop
    last_loss: float | None = None

    def run(self, steps: int, summary: bool) -> tuple[float, float]:
        """One timed loop of `steps` steps: (seconds per step, input wait per step)."""
        began = time.perf_counter()
        result = self.trainer.train_loop(self.iterator, steps)
        if summary:
            measure_lib.summary_scalars(self.trainer, steps)
        seconds = (time.perf_counter() - began) / steps
        self.last_loss = result.loss_sum / max(result.steps, 1)
        return seconds, result.input_wait / max(result.steps, 1)


def validated_variants() -> tuple[list, list]:
    """([(variant, Config)], [(variant, reason) skipped]); UsageError/SpecError/ConfigError."""
    from mgloop.runs.config import Config
    from mgloop.errors import ConfigError
    unknown = sorted(set(_FLAGS.measure) - set(measure_lib.MEASURES))
    if unknown:
        raise UsageError(f"--measure={','.join(unknown)} is not one of: "
                         f"{', '.join(measure_lib.MEASURES)}")
    if _FLAGS.input_delay_ms == "auto" and "ideal" not in _FLAGS.measure:
        raise UsageError("--input_delay_ms=auto calibrates on t_compute: add --measure=ideal")
    if _FLAGS.input_delay_ms not in (None, "auto"):
        try:
            if not float(_FLAGS.input_delay_ms) >= 0:
                raise ValueError
        except ValueError:
            raise UsageError(f"--input_delay_ms={_FLAGS.input_delay_ms!r}: give milliseconds "
                             "(>= 0) or auto") from None
    from mgloop.observe import link_model
    link_model.check_links(tuple(_FLAGS.link))
    if _FLAGS.copies not in (1, 2) or min(_FLAGS.steps, _FLAGS.repeats) < 1:
        raise UsageError("--copies must be 1 or 2, --steps and --repeats at least 1")
    chosen, skipped = [], []
    for variant in variants_spec.variants(_FLAGS.vary, _FLAGS.set):
        settings = {"train_steps": 10 ** 9, "plugins": tuple(_FLAGS.plugin),
                    "logdir": os.path.join(tempfile.gettempdir(), "mgloop-variants"),
                    **variant.settings}
        try:
            chosen.append((variant, Config(**settings).validated()))
        except ConfigError as error:
            if not _FLAGS.skip_invalid:
                raise ConfigError(f"variant {variant.name}: {error}") from None
            skipped.append((variant, str(error)))
            logging.warning("skipping variant %s: %s", variant.name, error)
    for key in _FLAGS.group:
        if key not in variants_spec.field_types():
            raise UsageError(f"--group={key}: not a Config field")
    if not chosen:
        raise UsageError("every variant was refused; nothing to measure")
    return chosen, skipped


def input_delay(reference, time_input) -> float:
    """Seconds of the slow input's delay per batch (see variants_measure)."""
    if _FLAGS.input_delay_ms is None:
        return 0.0
    if _FLAGS.input_delay_ms != "auto":
        return float(_FLAGS.input_delay_ms) / 1e3  # checked by validated_variants
    free = iter(reference.dataset.train_batches(reference.config.global_batch_size,
                                                reference.config.seed).prefetch(2))
    for _ in range(_FLAGS.warmup):
        reference.run(_FLAGS.steps, False), time_input(free, _FLAGS.steps)
    t_compute = np.median([reference.run(_FLAGS.steps, False)[0] for _ in range(3)])
    t_free = np.median([time_input(free, _FLAGS.steps) for _ in range(3)])
    return max(float(t_compute - t_free), 0.0)


def build_all(chosen) -> tuple[list[Build], dict]:
    """The builds (copies in the order v1..vn, vn..v1) and the input references of `ideal`."""
    datasets = {}

    def build(variant, copy, config, transform=None, constant=False):
        key = (config.dataset, config.seed, config.data_dir)
        trainer, iterator, datasets[key] = benchlib.build_config(
            config, datasets.get(key), transform=transform)
        if constant:  # one batch, over and over: input costs next to nothing
            import tensorflow as tf
            batch = next(iter(datasets[key].train_batches(config.global_batch_size,
                                                          config.seed)))
            iterator = iter(tf.data.Dataset.from_tensors(batch).repeat())
        return Build(variant, copy, config, trainer, iterator, datasets[key])

    references = {}
    delay = 0.0
    if "ideal" in _FLAGS.measure:
        variant, config = chosen[0]
        time_input = measure_lib.make_input_timer()
        compute = build(dataclasses.replace(variant, name="compute"), 0,
                        dataclasses.replace(config, staging="device"), constant=True)
        delay = input_delay(compute, time_input)
        stream = measure_lib.slow_stream(
            compute.dataset.train_batches(config.global_batch_size, config.seed), delay)
        references = {"compute": compute, "input": (time_input, iter(stream.prefetch(2)))}
    else:
        delay = input_delay(None, None)
    order = [(v, c, 0) for v, c in chosen]
    if _FLAGS.copies == 2:
        order += [(v, c, 1) for v, c in reversed(chosen)]
    builds = [build(v, copy, c, lambda batches: measure_lib.slow_stream(batches, delay))
              for v, c, copy in order]
    references["delay_s"] = delay
    return builds, references


def time_interleaved(builds: list[Build], references: dict) -> dict:
    """`--warmup` untimed loops of each build, then `--repeats` rounds side by side in a
    rotating order (benchlib.rounds): each build's `times` and `waits` are its timed loops';
    returns the references' times (`ideal`: compute and input, in the same rounds)."""
    summary = "summary" in _FLAGS.measure
    runs = {index: (lambda b=b: b.run(_FLAGS.steps, summary))
            for index, b in enumerate(builds)}
    if "compute" in references:
        compute = references["compute"]
        time_input, stream = references["input"]
        runs["compute"] = lambda: compute.run(_FLAGS.steps, False)
        runs["input"] = lambda: time_input(stream, _FLAGS.steps)
    timed = benchlib.rounds(runs, _FLAGS.repeats, _FLAGS.warmup)
    for index, b in enumerate(builds):
        b.times = [seconds for seconds, _ in timed[index]]
        b.waits = [wait for _, wait in timed[index]]
    if "compute" not in references:
        return {"compute": [], "input": []}
    return {"compute": [seconds for seconds, _ in timed["compute"]], "input": timed["input"]}


def extra_measures(build: Build) -> dict:
    out = {}
    measures = _FLAGS.measure
    if "input_wait" in measures:
        out["input_wait_ms"] = 1e3 * float(np.median(build.waits))
    if "traffic" in measures:
        out.update(measure_lib.traffic(build.trainer))
    if "exchange" in measures or _FLAGS.link:
        out.update(measure_lib.exchange(build.trainer, _FLAGS.repeats))
    if _FLAGS.link:
        from mgloop.observe import link_model
        out.update(measure_lib.link(build.trainer, [link_model.parse(t) for t in _FLAGS.link],
                                    float(np.median(build.times)), out["exchange_ms"]))
    if "memory" in measures:
        out.update(measure_lib.memory(build.trainer, build.iterator, _FLAGS.steps))
    if "breakdown" in measures:
        out.update(measure_lib.breakdown(build.trainer, build.iterator, _FLAGS.repeats))
    if "eval" in measures:
        out.update(measure_lib.evaluate(build.trainer, build.dataset,
                                        build.config.global_batch_size))
    return out


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from mgloop.errors import ConfigError
    try:  # every refusal before any device or variable exists
        benchlib.load_plugins(_FLAGS.plugin)
        chosen, skipped = validated_variants()
    except (UsageError, ConfigError, variants_spec.SpecError, benchlib.PluginError) as error:
        print(f"variants.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    output_dir = _FLAGS.output_dir or tempfile.mkdtemp(prefix="mgloop-variants-")
    from mgloop.cluster import devices
    devices.configure_logical_cpus(max(config.num_towers for _, config in chosen))
    builds, references = build_all(chosen)
    logging.info("%d builds of %d variants", len(builds), len(chosen))
    ref_times = time_interleaved(builds, references)
    rows = variants_report.rows(chosen, builds, _FLAGS.group, extra_measures)
    ideal = variants_report.add_ideal(rows, ref_times, references.get("delay_s", 0.0), chosen)
    command = benchlib.command_line()
    settings = {"steps": _FLAGS.steps, "warmup": _FLAGS.warmup, "repeats": _FLAGS.repeats,
                "copies": _FLAGS.copies, "measure": list(_FLAGS.measure),
                "vary": list(_FLAGS.vary), "set": list(_FLAGS.set),
                "plugins": list(_FLAGS.plugin), "group": list(_FLAGS.group),
                "links": list(_FLAGS.link),
                "input_delay_ms": _FLAGS.input_delay_ms}
    payload = {"command": command, "machine": benchlib.machine(), "settings": settings,
               "ideal": ideal, "rows": rows,
               "skipped": [{"variant": v.name, "reason": reason} for v, reason in skipped]}
    table = variants_report.markdown(payload, _FLAGS.measure, _FLAGS.copies)
    variants_report.write(output_dir, payload, table)
    variants_report.write_tensorboard(os.path.join(output_dir, "tensorboard"), chosen, rows)
    print(table)
    print(f"outputs in {output_dir}")


if __name__ == "__main__":
    app.run(main)
