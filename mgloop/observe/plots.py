"""A study's plots: an eval metric against an x axis, one line per variant, the mean
over seeds with a band of ± one sample sd (stats.py) where there are two or more seeds.

`plot(groups, metric, x_of, ...)` takes the sweep's records (dicts with a `curve` of eval
points, runs/sweep/record.py) grouped by variant; `x_of(point)` reads the x value (steps,
gradient bytes, modelled seconds). matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import os

from mgloop.observe import stats


def series(recs: list[dict], metric: str, x_of) -> tuple[list, list, list]:
    """(x, mean, sd) at the eval steps the seeds share (x: the mean of the seeds' x)."""
    steps = sorted(set.intersection(*({p["step"] for p in r["curve"]} for r in recs)))
    xs, means, sds = [], [], []
    for step in steps:
        points = [next(p for p in r["curve"] if p["step"] == step) for r in recs]
        x, _, _ = stats.mean_sd([x_of(p) for p in points])
        mean, sd, n = stats.mean_sd([p.get(metric) for p in points])
        if x is None or mean is None:
            continue
        xs.append(x), means.append(mean), sds.append(sd or 0.0)
    return xs, means, sds


def plot(groups: dict[str, list[dict]], metric: str, x_of, xlabel: str, path: str,
         title: str, log_x: bool = False) -> str:
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    figure, axes = plt.subplots(figsize=(10, 4.8), dpi=110)
    colours = plt.get_cmap("tab20" if len(groups) > 10 else "tab10").colors
    for index, (name, recs) in enumerate(groups.items()):
        xs, means, sds = series(recs, metric, x_of)
        if not xs:
            continue
        line, = axes.plot(xs, means, label=name, linewidth=1.4,
                          color=colours[index % len(colours)],
                          linestyle=("-", "--", ":")[index // len(colours) % 3])
        if len(recs) > 1:
            axes.fill_between(xs, [m - s for m, s in zip(means, sds)],
                              [m + s for m, s in zip(means, sds)], color=line.get_color(),
                              alpha=0.18, linewidth=0)
    if log_x:
        axes.set_xscale("symlog", linthresh=1e3)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(metric.removeprefix("eval/") + " (eval)")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
