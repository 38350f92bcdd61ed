"""What experiments/variants.py reports: rows, the markdown table, JSON and TensorBoard HParams.

Ratios: a variant's median step over its baseline's (the first variant, or the
first of its `--group`). With two builds per variant, the paired ratio is the
median over rounds of (the variant's two loops) / (the baseline's two loops)
of the same round, with the standard error of that median (1.2533 · 1.4826 ·
MAD / sqrt(rounds), for a normal spread); the A/A control is the median over
rounds of the variant's second build over its first.
"""

from __future__ import annotations

import os

import numpy as np

from experiments import benchlib

# (key, header, format) of the columns a row may have, in table order
COLUMNS = [("variant", "variant", "s"), ("examples_per_sec", "examples/sec (median)", ".0f"),
           ("mad_examples_per_sec", "± MAD", ".0f"), ("step_ms", "step (ms)", ".3f"),
           ("ratio", "step ÷ baseline", ".2f"), ("paired_ratio", "paired ratio", ".3f"),
           ("paired_se", "± std. error", ".3f"), ("aa_control", "A/A control", ".3f"),
           ("loss", "loss, last loop", ".4f"), ("input_wait_ms", "input wait (ms/step)", ".2f"),
           ("ratio_to_ideal", "ratio to ideal", ".2f"),
           ("exchange_ms", "exchange alone (ms)", ".3f"),
           ("max_sent_kib", "max sent/device/step (KiB)", ".1f"),
           ("max_received_kib", "max received/device/step (KiB)", ".1f"),
           ("factored", "variables factored", "d"), ("ordered", "variables summed in order", "d"),
           ("loop_peak_mib", "allocator peak above start (MiB)", ".0f"),
           ("eval_loss", "eval loss", ".4f"), ("eval_accuracy", "eval accuracy", ".4f"),
           ("bytes_per_device_kib", "bytes/device/step (KiB)", ".1f"),
           ("compression_ratio", "compression (baseline bytes ÷ bytes)", ".2f"),
           ("messages_per_device", "messages/device/step", ".3g"),
           ("compute_ms", "compute (ms): step − exchange alone", ".3f")]
# --link columns, per link TAG (link_model.Link.tag): (key suffix, header)
LINK_COLUMNS = [("exchange_ms", "modelled exchange at {} (ms)"),
                ("step_ms", "modelled step at {} (ms)"),
                ("step_overlap_ms", "modelled step at {}, overlapped (ms)")]


def rows(chosen, builds, group: list[str], extra) -> list[dict]:
    """One row per variant (in `chosen` order); `extra(build)` -> the --measure figures."""
    by_name = {variant.name: [b for b in builds if b.variant.name == variant.name]
               for variant, _ in chosen}
    baselines = {}
    for variant, config in chosen:
        baselines.setdefault(tuple(getattr(config, key) for key in group), variant.name)
    out = []
    for variant, config in chosen:
        mine = by_name[variant.name]
        base = by_name[baselines[tuple(getattr(config, key) for key in group)]]
        times = np.concatenate([b.times for b in mine])
        median, mad = benchlib.median_and_mad(times)
        base_median, _ = benchlib.median_and_mad(np.concatenate([b.times for b in base]))
        batch = config.global_batch_size
        row = {"variant": variant.name, "baseline": base[0].variant.name,
               "settings": dict(variant.varied), "global_batch": batch,
               "examples_per_sec": batch / median,
               "mad_examples_per_sec": batch * mad / median ** 2,
               "step_ms": 1e3 * median, "mad_step_ms": 1e3 * mad, "ratio": median / base_median,
               "loss": mine[0].last_loss,
               "step_ms_repeats": [[1e3 * t for t in b.times] for b in mine]}
        if len(mine) == 2:
            paired = np.sum([b.times for b in mine], 0) / np.sum([b.times for b in base], 0)
            middle, spread = benchlib.median_and_mad(paired)
            aa, _ = benchlib.median_and_mad(np.divide(mine[1].times, mine[0].times))
            row.update(paired_ratio=middle, aa_control=aa,
                       paired_se=1.2533 * 1.4826 * spread / np.sqrt(len(paired)))
        row.update(extra(mine[0]))
        out.append(row)
    by_variant = {row["variant"]: row for row in out}
    for row in out:  # --link: the baseline's bytes per device over the variant's
        base_bytes = by_variant[row["baseline"]].get("bytes_per_device_kib")
        if row.get("bytes_per_device_kib") and base_bytes is not None:
            row["compression_ratio"] = base_bytes / row["bytes_per_device_kib"]
    return out


def add_ideal(rows_: list[dict], ref_times: dict, delay: float, chosen) -> dict | None:
    """With --measure=ideal: each row's ratio to 1 / max(t_input, t_compute); the figures."""
    if not ref_times.get("compute"):
        return None
    t_compute = float(np.median(ref_times["compute"]))
    t_input = float(np.median(ref_times["input"]))
    ideal = max(t_compute, t_input)
    for row in rows_:
        row["ratio_to_ideal"] = ideal / (row["step_ms"] / 1e3)
    batch = chosen[0][1].global_batch_size
    return {"delay_ms": 1e3 * delay, "t_input_ms": 1e3 * t_input, "t_compute_ms": 1e3 * t_compute,
            "ideal_examples_per_sec": batch / ideal}


def markdown(payload: dict, measures: list[str], copies: int) -> str:
    rows_ = payload["rows"]
    settings = payload["settings"]
    present = {key for row in rows_ for key, value in row.items() if value is not None}
    columns = [c for c in COLUMNS if c[0] in present]
    known = {key for key, _, _ in COLUMNS}
    columns += [(key, f"profiled {key[len('breakdown_'):-len('_ms')]} (ms)", ".3f")
                for key in sorted(present - known) if key.startswith("breakdown_")]
    from mgloop.observe import link_model
    for link in map(link_model.parse, settings.get("links", [])):
        columns += [(f"link_{link.tag}_{suffix}", header.format(link.name), ".3f")
                    for suffix, header in LINK_COLUMNS if f"link_{link.tag}_{suffix}" in present]
    lines = [f"Command: `{payload['command']}`", "",
             f"{settings['steps']} steps per timed loop, {settings['repeats']} interleaved "
             f"repeats after {settings['warmup']} warm-up loops, {copies} build(s) per variant; "
             f"load average {payload['machine']['load_average'][0]:.1f} at the end; baseline "
             f"of the ratios: {rows_[0]['baseline']}"
             + (f" (first of each {', '.join(settings['group'])})" if settings["group"] else "")]
    if payload.get("ideal"):
        ideal = payload["ideal"]
        lines.append(f"input delay {ideal['delay_ms']:.2f} ms/batch; t_input "
                     f"{ideal['t_input_ms']:.2f} ms, t_compute {ideal['t_compute_ms']:.2f} ms; "
                     f"ideal {ideal['ideal_examples_per_sec']:.0f} examples/sec")
    lines += ["", benchlib.markdown(rows_, columns)]
    for skipped in payload["skipped"]:
        lines.append(f"\nskipped {skipped['variant']}: {skipped['reason']}")
    return "\n".join(lines)


def write(output_dir: str, payload: dict, table: str) -> None:
    """variants.json and variants.md in `output_dir`, each replaced at once."""
    os.makedirs(output_dir, exist_ok=True)
    benchlib.write_json(os.path.join(output_dir, "variants.json"), payload)
    tmp = os.path.join(output_dir, ".variants.md.tmp")
    with open(tmp, "w") as handle:
        handle.write(table + "\n")
    os.replace(tmp, os.path.join(output_dir, "variants.md"))


def _hparam_value(value):
    if value is None:
        return "none"
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return value


def metric_names(rows_: list[dict]) -> list[str]:
    """The numeric figures of the rows (TensorBoard scalars and HParams metrics)."""
    names = []
    for row in rows_:
        for key, value in row.items():
            if (isinstance(value, (int, float)) and not isinstance(value, bool)
                    and key not in names and key != "global_batch"):
                names.append(key)
    return names


def write_tensorboard(logdir: str, chosen, rows_: list[dict]) -> None:
    """One run per variant (as hparams what a training run records: every setting that can
    change a result, run_dir.hparams_of; its figures as scalars at step 0, examples/sec per
    timed loop), and the HParams experiment at the top."""
    import tensorflow as tf
    from tensorboard.plugins.hparams import api as hp
    from mgloop.runs import run_dir
    values = [{name: _hparam_value(value)
               for name, value in run_dir.hparams_of(config, config.num_towers).items()}
              for _, config in chosen]
    # every hparam of any variant (a method's options, aggregation/KEY, are its own)
    names = list(dict.fromkeys(name for hparams in values for name in hparams))
    for name in names:  # one type per hparam, as a Discrete domain needs
        present = [v for v in values if name in v]
        if len({type(v[name]) for v in present}) > 1:
            for v in present:
                v[name] = str(v[name])
    domains = [hp.HParam(name, hp.Discrete(sorted({v[name] for v in values if name in v})))
               for name in names]
    metrics = metric_names(rows_)
    with tf.summary.create_file_writer(logdir).as_default():
        hp.hparams_config(hparams=domains,
                          metrics=[hp.Metric(m, display_name=m) for m in metrics])
    for (variant, _), hparams, row in zip(chosen, values, rows_):
        run = os.path.join(logdir, variant.name.replace("/", "+"))
        with tf.summary.create_file_writer(run).as_default():
            hp.hparams(hparams, trial_id=variant.name)
            for metric in metrics:
                if isinstance(row.get(metric), (int, float)):
                    tf.summary.scalar(metric, row[metric], step=0)
            for repeat, step_ms in enumerate(row["step_ms_repeats"][0]):
                tf.summary.scalar("examples_per_sec_repeat",
                                  row["global_batch"] / (step_ms / 1e3), step=repeat)
