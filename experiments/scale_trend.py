"""The scale trend of the language-model studies: each method's gap to the synchronous ring
against the model's parameter count.

    python -m experiments.scale_trend [--plot=docs/results/img/lm_scale_trend.png]

Reads the final records (results/VARIANT/seed=N.json, the tuned point's seeds) of the
studies that train `transformer_lm` at three sizes under the protocol of
experiments/studies/lm_protocol.flags at 77 tokens per parameter: lm_scale_7k and
lm_scale_36k, and at the protocol's own size the rows of lm_local_updates (ring, DiLoCo),
lm_sparse_averaging (SPARTA with DiLoCo) and lm_compression (QSGD, the compressed method
with the lowest final perplexity at that size). Each size is read from the flagfile that
trains it (its --set=lm_layers, lm_width, lm_heads, with the flagfiles it includes) and
its parameters counted on the model itself.

The gap (Charles et al. 2025, "Scaling Laws for DiLoCo", arXiv 2503.09799, their Figure 1:
the percentage difference in evaluation loss to data-parallel training):

    gap_m = 100 (L_m - L_ring) / L_ring

with L the mean over seeds of the final evaluation loss (log perplexity) of the model the
method produces, and its standard error sqrt(s_m^2 / n_m + s_ring^2 / n_ring) / L_ring * 100
(s the sample sd over seeds; the seeds are paired by number but their runs are
independent). Prints a table (mean +- sd of the perplexity per size and method, the gap
+- its standard error) and draws the gap against the parameters on a log axis, one
colour per method, the ring at 0.
"""

from __future__ import annotations

import glob
import json
import math
import os
import statistics

from absl import app
from absl import flags

FLAGS = flags.FLAGS
STUDIES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "studies")

# The flagfile whose model size a row has (its --set=lm_layers/lm_width/lm_heads, else the
# model's defaults) -> {method: (study, the variant's folder name before its hash)}
SIZES = {
    "lm_scale_7k": {"ring": ("lm_scale_7k", "aggregation=ring"),
                    "DiLoCo H=64": ("lm_scale_7k", "aggregation=diloco_period=64"),
                    "SPARTA+DiLoCo H=64": ("lm_scale_7k", "aggregation=sparta_diloco_period=64"),
                    "QSGD": ("lm_scale_7k", "aggregation=qsgd")},
    "lm_scale_36k": {"ring": ("lm_scale_36k", "aggregation=ring"),
                     "DiLoCo H=64": ("lm_scale_36k", "aggregation=diloco_period=64"),
                     "SPARTA+DiLoCo H=64": ("lm_scale_36k",
                                            "aggregation=sparta_diloco_period=64"),
                     "QSGD": ("lm_scale_36k", "aggregation=qsgd")},
    "lm_protocol": {"ring": ("lm_local_updates", "aggregation=ring"),
                    "DiLoCo H=64": ("lm_local_updates", "aggregation=diloco_period=64"),
                    "SPARTA+DiLoCo H=64": ("lm_sparse_averaging",
                                           "aggregation_optimizer=sparta_diloco_period=64_adam"),
                    "QSGD": ("lm_compression", "aggregation=qsgd")},
}
MODEL_SETTINGS = ("lm_layers", "lm_width", "lm_heads")


def model_settings(studies: str, flagfile: str) -> dict[str, int]:
    """The --set=lm_layers/lm_width/lm_heads the flagfile trains with (those it leaves out:
    the model's defaults), read from the file the study runs, so the size cannot drift. A
    --flagfile= line is followed where it stands, as absl reads it (the later line wins);
    every study's flagfile lives in `studies`, so an include is found there by its name."""
    settings = {}
    with open(os.path.join(studies, flagfile + ".flags")) as handle:
        for line in handle:
            line = line.strip()
            if line.startswith("--flagfile="):
                included = os.path.basename(line.removeprefix("--flagfile="))
                settings.update(model_settings(studies, included.removesuffix(".flags")))
            key, _, value = line.removeprefix("--set=").partition("=")
            if line.startswith("--set=") and key in MODEL_SETTINGS:
                settings[key] = int(value)
    return settings


def final_losses(studies: str, study: str, variant: str) -> list[float]:
    """The final eval losses of a variant's final seeds (none if it has not run)."""
    folders = glob.glob(os.path.join(studies, study, "results", variant + "-*"))
    losses = []
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "seed=*.json"))):
            with open(path) as handle:
                record = json.load(handle)
            loss = (record.get("eval") or {}).get("loss")
            losses.append(float("nan") if loss is None else float(loss))
    return losses


def mean_sd(values: list[float]) -> tuple[float, float]:
    """(mean, sample sd) over seeds; NaN both if a seed diverged (NaN)."""
    if any(math.isnan(x) for x in values):
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def gap(losses: list[float], ring: list[float]) -> tuple[float, float]:
    """(100 (mean(losses) - mean(ring)) / mean(ring), its standard error): see the module
    docstring. A diverged seed (NaN) makes the gap NaN: never silently dropped."""
    if any(math.isnan(x) for x in losses + ring):
        return math.nan, math.nan
    mean, base = statistics.fmean(losses), statistics.fmean(ring)
    spread = sum(statistics.variance(x) / len(x) for x in (losses, ring) if len(x) > 1)
    return 100 * (mean - base) / base, 100 * math.sqrt(spread) / base


def parameters(settings: dict[str, int]) -> int:
    """transformer_lm's parameter count at these settings (sequences of 64 bytes)."""
    from mgloop import models  # loads TensorFlow
    return int(models.get("transformer_lm")((64,), 256, **settings).count_params())


def rows(studies: str) -> list[dict]:
    """One row per size and method that has final records."""
    out = []
    for flagfile, methods in SIZES.items():
        ring = final_losses(studies, *methods["ring"])
        if not ring:
            continue
        count = parameters(model_settings(studies, flagfile))
        for method, (study, variant) in methods.items():
            losses = final_losses(studies, study, variant)
            if not losses:
                continue
            perplexity, perplexity_sd = mean_sd([math.exp(x) for x in losses])
            row = dict(parameters=count, method=method, seeds=len(losses), study=study,
                       perplexity=perplexity, perplexity_sd=perplexity_sd)
            row["gap"], row["gap_se"] = gap(losses, ring) if method != "ring" else (0.0, 0.0)
            out.append(row)
    return out


def table(found: list[dict]) -> str:
    lines = ["| parameters | method | seeds | final perplexity | gap to the ring (% of its loss) |",
             "|---|---|---|---|---|"]
    for row in found:
        lines.append(f"| {row['parameters']:,} | {row['method']} | {row['seeds']} | "
                     f"{row['perplexity']:.3f} ± {row['perplexity_sd']:.3f} | "
                     + (f"{row['gap']:+.2f} ± {row['gap_se']:.2f} |" if row["method"] != "ring"
                        else "0 (the baseline) |"))
    return "\n".join(lines)


def plot(found: list[dict], path: str):
    """Draws the gap against the parameters into `path` and returns the axes; a method with
    a diverged seed at a size (NaN gap) is marked there with an x at the top."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot
    figure, axis = pyplot.subplots(figsize=(6, 4))
    axis.axhline(0, color="black", linewidth=1, label="ring (synchronous AdamW)")
    methods = [m for m in dict.fromkeys(r["method"] for r in found) if m != "ring"]
    for colour, method in ((f"C{i}", m) for i, m in enumerate(methods)):  # none dropped
        points = sorted((r["parameters"], r["gap"], r["gap_se"])
                        for r in found if r["method"] == method)
        kept = [point for point in points if not math.isnan(point[1])]
        if kept:
            xs, ys, errors = zip(*kept)
            axis.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, color=colour,
                          label=method)
        for size in (point[0] for point in points if math.isnan(point[1])):
            axis.plot([size], [1], marker="x", color=colour, linestyle="none",
                      transform=axis.get_xaxis_transform(), clip_on=False,
                      label=f"{method}: a seed diverged")  # marked at the top, not dropped
    axis.set_xscale("log")
    sizes = sorted({r["parameters"] for r in found})
    axis.set_xticks(sizes, [f"{size:,}" for size in sizes])  # each size trained, named
    axis.minorticks_off()
    axis.set_xlabel("parameters (transformer_lm, 77 tokens per parameter)")
    axis.set_ylabel("eval loss above the ring's (%), ± standard error")
    axis.set_title("Gap to synchronous training against model size (4 nodes, 3 seeds)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return axis


def main(argv):
    del argv
    found = rows(FLAGS.studies)
    print(table(found))
    if FLAGS.plot:
        plot(found, FLAGS.plot)
        print(f"figure: {FLAGS.plot}")


if __name__ == "__main__":  # flags made here: a test may import the module
    flags.DEFINE_string("plot", None, "write the figure here (PNG)")
    flags.DEFINE_string("studies", STUDIES, "the folder of the studies")
    app.run(main)
