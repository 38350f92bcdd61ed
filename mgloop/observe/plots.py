"""A study's plots: an eval metric against an x axis, as small multiples.

`plot(panels, metric, x_of, ...)` draws one figure with one panel (a matplotlib Axes) per
entry of `panels` ({panel title: {curve label: records}}, the sweep's records, dicts
with a `curve` of eval points, runs/sweep/record.py), at most 3 panels a row, every
panel on the same y scale so that levels compare across them; `x_of(point)` reads the x
value (steps, gradient bytes, modelled seconds). Each curve is, at the eval steps its
seeds share,

    mean(s) = (1/n) sum_i m_i(s)                 (the line)
    band(s) = [min_i m_i(s), max_i m_i(s)]        (shaded, with two or more seeds)

over the n seeds' metric m_i (stats.py), at x = the mean of the seeds' x: the band holds
every seed's value. Which curves share a panel is the caller's choice (the sweep's report:
at most ~6 a panel). matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import math
import os
import textwrap

from mgloop.observe import stats

COLUMNS = 3  # panels a row


def series(recs: list[dict], metric: str, x_of) -> tuple[list, list, list, list]:
    """(x, mean, low, high) at the eval steps the seeds share (module docstring)."""
    steps = sorted(set.intersection(*({p["step"] for p in r["curve"]} for r in recs)))
    xs, means, lows, highs = [], [], [], []
    for step in steps:
        points = [next(p for p in r["curve"] if p["step"] == step) for r in recs]
        x, _, _ = stats.mean_sd([x_of(p) for p in points])
        values = stats.finite([p.get(metric) for p in points])
        if x is None or not values:
            continue
        xs.append(x)
        means.append(stats.mean_sd(values)[0])
        lows.append(min(values))
        highs.append(max(values))
    return xs, means, lows, highs


def figure(panels: dict[str, dict[str, list[dict]]], metric: str, x_of, xlabel: str,
           title: str, log_x: bool = False):
    """The matplotlib Figure: one Axes per panel (no empty ones)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    count = max(1, len(panels))
    columns = min(COLUMNS, count)
    rows = math.ceil(count / columns)
    width = max(7.0, 4.6 * columns + 0.6)
    fig, grid = plt.subplots(rows, columns, figsize=(width, 3.6 * rows + 0.9), dpi=110,
                             sharey=True, squeeze=False)
    cells = [axes for row in grid for axes in row]
    for axes in cells[count:]:
        fig.delaxes(axes)
    most = max((len(curves) for curves in panels.values()), default=1)
    colours = plt.get_cmap("tab20" if most > 10 else "tab10").colors
    for axes, (heading, curves) in zip(cells, panels.items()):
        for index, (label, recs) in enumerate(curves.items()):
            xs, means, lows, highs = series(recs, metric, x_of)
            if not xs:
                continue
            line, = axes.plot(xs, means, label=label, linewidth=1.4,
                              color=colours[index % len(colours)],
                              linestyle=("-", "--", ":")[index // len(colours) % 3])
            if len(recs) > 1:
                axes.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.18,
                                  linewidth=0)
        if log_x:
            axes.set_xscale("symlog", linthresh=1e3)
        axes.set_xlabel(xlabel, fontsize=8)
        axes.set_title(heading, fontsize=9)
        axes.grid(alpha=0.3)
        axes.tick_params(labelsize=7)
        if curves:
            axes.legend(fontsize=6.5, loc="best")
    for row in grid:
        row[0].set_ylabel(metric.removeprefix("eval/") + " (eval)")
    heading = textwrap.fill(title, width=int(width * 11))  # ~11 characters an inch at 10 pt
    fig.suptitle(f"{heading}\nmean over seeds; band: min to max over seeds", fontsize=10)
    fig.tight_layout()
    return fig


def plot(panels: dict[str, dict[str, list[dict]]], metric: str, x_of, xlabel: str, path: str,
         title: str, log_x: bool = False) -> str:
    """Saves `figure(...)` as `path` (PNG); returns the path."""
    fig = figure(panels, metric, x_of, xlabel, title, log_x)  # selects Agg first
    from matplotlib import pyplot as plt
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
