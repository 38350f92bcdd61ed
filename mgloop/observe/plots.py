"""A study's plots: an eval metric against an x axis, as small multiples.

`plot(panels, metric, x_of, ...)` draws one figure with one panel (a matplotlib Axes) per
entry of `panels` ({panel title: {curve label: records}}, the sweep's records, dicts
with a `curve` of eval points, runs/sweep/record.py), at most 3 panels a row, every
panel on the same y scale so that levels compare across them; `x_of(point)` reads the x
value (steps, gradient bytes, modelled seconds; None where the point has none). Each
curve is, at the eval steps its seeds share,

    mean(s) = (1/n) sum_i m_i(s)                 (the line)
    band(s) = [min_i m_i(s), max_i m_i(s)]        (shaded, with two or more seeds)

over the n seeds' metric m_i (stats.py), at x = the mean of the seeds' x: the band holds
every seed's value. Which curves share a panel is the caller's choice (the sweep's report:
at most ~6 a panel, and its baseline in each).

Diverged seeds. A seed diverged if its record says so (`diverged`, record.py: its loss
became NaN or infinite; its curve holds the evals made before) or its curve has a
non-finite value of the metric (its curve then ends before that point). The line and
band are over the seeds that did not diverge; when every seed diverged, over the
diverged seeds' finite points. Each diverged seed is an 'x' at its last finite point
(at its own x, or the line's x at that step where its record knows none: a diverged
record has no bytes or seconds), and the curve's legend entry reads
"LABEL (diverged: k/n seeds)" with the 'x' on it. Every curve has an entry in its
panel's legend (under the panel's x label, off the curves; a long label wrapped to the
panel's width, and the saved figure grown to hold it): one with nothing to draw on
this axis (no finite point with an x) reads "LABEL (diverged: k/n seeds; nothing to
plot)" or "LABEL (no points)", never dropped.

Styles. `styles` gives each curve label its colour and line style ({label: matplotlib
keywords}, `palette`): the caller passes the same map to every figure of a report, so a
curve keeps its colour in every panel and every figure. Without it, labels take the
palette in the order they first appear over the panels (the same label, the same style).

Log x (`log_x`, for bytes and seconds): a true log scale when every x drawn is > 0;
when some x is 0 (a method that has sent nothing by its first eval), symlog, linear
below linthresh = the power of ten at or below the least positive x and log above,
so that no point is dropped; linear when no x is > 0. Steps stay linear.
matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import math
import os
import textwrap

from mgloop.observe import stats

COLUMNS = 3  # panels a row
LINESTYLES = ("-", "--", ":", "-.")  # after the 9 colours of tab10 (no grey), the next style
BASELINE_STYLE = {"color": "black", "linestyle": "-", "linewidth": 2.0,
                  "zorder": 1.8}  # under the curves it is the reference for
DIVERGED_MARKER = "x"


def palette(keys, baseline=()) -> dict[str, dict]:
    """{key: matplotlib keywords}, in the order of `keys` (repeats ignored): the keys in
    `baseline` black, thicker and beneath the others (BASELINE_STYLE), the others tab10's
    colours but its grey (the baseline's band is grey) solid, then dashed, dotted,
    dash-dotted."""
    from matplotlib import colormaps
    colours = [c for c in colormaps["tab10"].colors if len(set(c)) > 1]  # no grey: the band
    out: dict[str, dict] = {}
    index = 0
    for key in keys:
        if key in out:
            continue
        if key in baseline:
            out[key] = dict(BASELINE_STYLE)
            continue
        out[key] = {"color": colours[index % len(colours)],
                    "linestyle": LINESTYLES[index // len(colours) % len(LINESTYLES)],
                    "linewidth": 1.4, "zorder": 2}
        index += 1
    return out


def _is_finite(value) -> bool:
    return value is not None and math.isfinite(float(value))


def diverged(rec: dict, metric: str) -> bool:
    """The seed diverged: its record says so, or its curve has a non-finite metric."""
    return bool(rec.get("diverged")) or any(
        p.get(metric) is not None and not _is_finite(p.get(metric)) for p in rec["curve"])


def finite_part(rec: dict, metric: str) -> dict:
    """The record with its curve cut before the first non-finite value of the metric."""
    kept = []
    for point in rec["curve"]:
        if point.get(metric) is not None and not _is_finite(point.get(metric)):
            break
        kept.append(point)
    return {**rec, "curve": kept}


def _series(recs: list[dict], metric: str, x_of) -> tuple[list, list, list, list, list]:
    """(steps, x, mean, low, high) at the eval steps the seeds share."""
    if not recs:
        return [], [], [], [], []
    steps = sorted(set.intersection(*({p["step"] for p in r["curve"]} for r in recs)))
    kept, xs, means, lows, highs = [], [], [], [], []
    for step in steps:
        points = [next(p for p in r["curve"] if p["step"] == step) for r in recs]
        x, _, _ = stats.mean_sd([x_of(p) for p in points])
        values = stats.finite([p.get(metric) for p in points])
        if x is None or not values:
            continue
        kept.append(step)
        xs.append(x)
        means.append(stats.mean_sd(values)[0])
        lows.append(min(values))
        highs.append(max(values))
    return kept, xs, means, lows, highs


def series(recs: list[dict], metric: str, x_of) -> tuple[list, list, list, list]:
    """(x, mean, low, high) at the eval steps the seeds share (module docstring)."""
    return _series(recs, metric, x_of)[1:]


def curve(recs: list[dict], metric: str, x_of) -> dict:
    """What one curve draws (module docstring): {"x", "mean", "low", "high"} over the
    seeds that did not diverge (every seed's finite part when all diverged), "seeds" (how
    many the line is over), "marks" ([(x, y)]: the diverged seeds' last finite points that
    have an x), "diverged" (how many seeds diverged) and "n" (seeds)."""
    bad = [r for r in recs if diverged(r, metric)]
    good = [r for r in recs if not diverged(r, metric)]
    parts = [finite_part(r, metric) for r in bad]
    used = good or [r for r in parts if r["curve"]]
    steps, xs, means, lows, highs = _series(used, metric, x_of)
    line_x = dict(zip(steps, xs))
    marks = []
    for part in parts:
        last = next((p for p in reversed(part["curve"]) if _is_finite(p.get(metric))), None)
        if last is None:
            continue
        x = x_of(last)
        x = x if _is_finite(x) else line_x.get(last["step"])
        if x is not None:
            marks.append((float(x), float(last[metric])))
    return {"x": xs, "mean": means, "low": lows, "high": highs, "seeds": len(used),
            "marks": marks, "diverged": len(bad), "n": len(recs)}


def legend_text(label: str, drawn: dict) -> str:
    """The curve's legend entry (module docstring)."""
    empty = not drawn["x"] and not drawn["marks"]
    if drawn["diverged"]:
        tail = "; nothing to plot" if empty else ""
        return f"{label} (diverged: {drawn['diverged']}/{drawn['n']} seeds{tail})"
    return f"{label} (no points)" if empty else label


def x_scale(values: list[float]) -> tuple[str, dict]:
    """(scale, keywords) of a log x axis over the x values drawn (module docstring)."""
    positive = [x for x in values if x > 0]
    if not positive:
        return "linear", {}
    if len(positive) == len(values):
        return "log", {}
    return "symlog", {"linthresh": 10.0 ** math.floor(math.log10(min(positive))),
                      "linscale": 0.5}


def figure(panels: dict[str, dict[str, list[dict]]], metric: str, x_of, xlabel: str,
           title: str, log_x: bool = False, styles: dict[str, dict] | None = None):
    """The matplotlib Figure: one Axes per panel (no empty ones)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.transforms import ScaledTranslation
    styles = {**palette(label for curves in panels.values() for label in curves),
              **(styles or {})}
    drawn = {heading: {label: curve(recs, metric, x_of) for label, recs in curves.items()}
             for heading, curves in panels.items()}
    count = max(1, len(panels))
    columns = min(COLUMNS, count)
    rows = math.ceil(count / columns)
    width = max(7.0, 4.6 * columns + 0.6)
    xlabel = textwrap.fill(xlabel, width=int(4.4 * 13))  # ~13 characters an inch at 8 pt
    under = 0.3 + 0.14 * (xlabel.count("\n") + 1)  # inches of tick labels and x label
    chars = int((width / columns - 0.6) * 15)  # ~15 characters an inch at 6.5 pt
    texts = {heading: [textwrap.fill(legend_text(label, one), width=chars,
                                     subsequent_indent="    ")
                       for label, one in curves.items()] for heading, curves in drawn.items()}
    entries = max((sum(t.count("\n") + 1 for t in lines) for lines in texts.values()),
                  default=0)  # legend lines, each long label wrapped to the panel's width
    title = textwrap.fill(title, width=int(width * 11))  # ~11 characters an inch at 10 pt
    fig, grid = plt.subplots(rows, columns, figsize=(
        width, (2.8 + under + 0.12 * entries) * rows + 0.2 * (title.count("\n") + 2) + 0.2),
        dpi=110, sharey=True, squeeze=False, layout="constrained")  # room for the legends
    cells = [axes for row in grid for axes in row]
    for axes in cells[count:]:
        fig.delaxes(axes)
    every_x = [x for curves in drawn.values() for one in curves.values()
               for x in one["x"] + [m[0] for m in one["marks"]]]
    scale, scale_keywords = x_scale(every_x) if log_x else ("linear", {})
    any_diverged = False
    for axes, (heading, curves) in zip(cells, drawn.items()):
        handles = []
        for label, one in curves.items():
            style = styles[label]
            if one["x"]:
                axes.plot(one["x"], one["mean"], **style)
                if one["seeds"] > 1:
                    axes.fill_between(one["x"], one["low"], one["high"],
                                      color=style["color"], alpha=0.18, linewidth=0,
                                      zorder=style["zorder"] - 1)
            if one["marks"]:
                axes.plot([m[0] for m in one["marks"]], [m[1] for m in one["marks"]],
                          linestyle="none", marker=DIVERGED_MARKER, markersize=7,
                          markeredgewidth=1.8, color=style["color"],
                          zorder=style["zorder"] + 1)
            any_diverged |= bool(one["diverged"])
            handles.append(Line2D([], [], **style,
                                  marker=DIVERGED_MARKER if one["diverged"] else None,
                                  markersize=7, markeredgewidth=1.8))
        axes.set_xscale(scale, **scale_keywords)
        axes.set_xlabel(xlabel, fontsize=8)
        axes.set_title(heading, fontsize=9)
        axes.grid(alpha=0.3)
        axes.tick_params(labelsize=7)
        if handles:
            below = axes.transAxes + ScaledTranslation(0, -under, fig.dpi_scale_trans)
            axes.legend(handles, texts[heading], fontsize=6.5, loc="upper center", frameon=False,
                        bbox_to_anchor=(0.5, 0), bbox_transform=below)  # under the x label
    for row in grid:
        row[0].set_ylabel(metric.removeprefix("eval/") + " (eval)")
    note = "mean over seeds; band: min to max over seeds"
    if any_diverged:
        note += f"; {DIVERGED_MARKER}: a diverged seed's last finite eval (not in the mean)"
    fig.suptitle(f"{title}\n{note}", fontsize=10)
    return fig


def plot(panels: dict[str, dict[str, list[dict]]], metric: str, x_of, xlabel: str, path: str,
         title: str, log_x: bool = False, styles: dict[str, dict] | None = None) -> str:
    """Saves `figure(...)` as `path` (PNG); returns the path."""
    fig = figure(panels, metric, x_of, xlabel, title, log_x, styles)  # selects Agg first
    from matplotlib import pyplot as plt
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, bbox_inches="tight", pad_inches=0.1)  # the legends under the axes
    plt.close(fig)
    return path
