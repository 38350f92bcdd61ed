"""A sweep's report: <output_dir>/report.md (tables) and <output_dir>/plots/*.png.

Per variant, over its seeds (stats.py: mean ± sample sd):

    final <metric>         the eval metric at the cell's last eval, over the seeds that did not
                           diverge ("diverged (k/n)": k seeds' loss became NaN or infinite)
    <metric> at B* MB      at equal bytes: the metric at the last eval by which the cell had
                           sent at most B* gradient bytes, B* the least any variant sent over
                           its run ("—" for a seed whose first eval came later)
    reached                seeds that met the target / seeds run
    steps / MB / s@link    time to target (record.py), over the seeds that reached it
    B/step                 gradient bytes per step averaged over the run's steps (between
                           nodes, or per device with one node): summary.json's
                           link_model.gradient_bytes_per_step (observe/link_report.py)
    ratio                  the first variant's mean bytes per step over this one's
    tuned to               with --tune: the values the variant's final seeds ran at; a
                           "Tuning" section (tuning_report.py) lists what was tried

The compute per step in every modelled second (record.py's C) is said under the table:
each distinct `compute_source` of the cells (--compute: measured on this machine, a
profile's F b / (P E), or given; observe/hardware.py) with the variants that used it.

Plots: one PNG per x axis (steps, the gradient bytes sent, the modelled seconds on each
--link), drawn by observe/plots.py in the panels and styles of plot_panels.py.
"""

from __future__ import annotations

import glob
import os

from mgloop.observe import stats
from mgloop.observe.plots import plot
from mgloop.runs.sweep import record as record_lib
from mgloop.runs.sweep import tuning_report
from mgloop.runs.sweep.plan import TUNING
from mgloop.runs.sweep.plot_panels import axis_keys, curve_styles, link_text, panels, tuned_text

LOWER_IS_BETTER = ("loss", "perplexity")


def load(output_dir: str) -> list[dict]:
    """The final cells' records (the tuning cells' are tuning_report.load's)."""
    tuning = os.path.join(output_dir, "results", TUNING) + os.sep
    return with_axes([record_lib.read(path) for path in
                      sorted(glob.glob(os.path.join(output_dir, "results", "**", "*.json"),
                                       recursive=True)) if not path.startswith(tuning)])


def with_axes(records: list[dict]) -> list[dict]:
    """The records, those written before records held their axes given them where the
    others vary one axis KEY: a variant "KEY=VALUE" has the axes [[KEY, VALUE]]."""
    keys = {tuple(k for k, _ in r["axes"]) for r in records if r.get("axes")}
    if len(keys) != 1 or len(next(iter(keys))) != 1:
        return records
    key = next(iter(keys))[0]
    for rec in records:
        if not rec.get("axes") and rec["variant"].startswith(f"{key}="):
            rec["axes"] = [[key, rec["variant"].removeprefix(f"{key}=")]]
    return records


def by_variant(records: list[dict], order: list[str] | None = None) -> dict[str, list[dict]]:
    """{variant: its records, by seed}, variants in `order` (the grid's) then by name."""
    groups: dict[str, list[dict]] = {}
    for rec in records:
        groups.setdefault(rec["variant"], []).append(rec)
    rank = {name: i for i, name in enumerate(order or [])}
    ordered = sorted(groups, key=lambda name: (rank.get(name, len(rank)), name))
    return {name: sorted(groups[name], key=lambda r: r["seed"]) for name in ordered}


def metric_of(records: list[dict], target: str | None) -> str:
    """The eval metric the report follows: the target's, else accuracy, else loss."""
    if target:
        name = target.split(">=")[0].split("<=")[0]
        return name if name.startswith("eval/") else f"eval/{name}"
    keys = set().union(*(set(r["curve"][-1]) for r in records if r["curve"])) if records else set()
    return "eval/accuracy" if "eval/accuracy" in keys else "eval/loss"


def _final(rec: dict, metric: str):
    return rec["curve"][-1].get(metric) if rec["curve"] else None


def mean_bytes_per_step(rec: dict) -> float | None:
    """The cell's gradient bytes per step: those sent through its last eval over its step
    (record.py: at the final step, summary.json's gradient_bytes_per_step)."""
    last = rec["curve"][-1] if rec["curve"] else None
    if not last or last["gradient_bytes"] is None or not last["step"]:
        return None
    return last["gradient_bytes"] / last["step"]


def at_bytes(rec: dict, metric: str, budget: float):
    """The metric at the last eval by which the cell had sent at most `budget` gradient
    bytes (None if it had sent more by its first eval, or bytes are not modelled)."""
    kept = [p for p in rec["curve"]
            if p["gradient_bytes"] is not None and p["gradient_bytes"] <= budget * (1 + 1e-9)]
    return kept[-1].get(metric) if kept else None


def equal_bytes_budget(groups: dict[str, list[dict]]) -> float | None:
    """B*: the least gradient bytes any variant sent over its whole run (its seeds' mean),
    the budget at which the report compares every variant ("at equal bytes")."""
    totals = [stats.mean_sd([r["curve"][-1]["gradient_bytes"] for r in recs if r["curve"]])[0]
              for recs in groups.values()]
    totals = [t for t in totals if t]
    return min(totals) if totals else None


def table(groups: dict[str, list[dict]], metric: str, links: list[str]) -> str:
    short = metric.removeprefix("eval/")
    budget = equal_bytes_budget(groups)
    tuned = any(r.get("tuned") for recs in groups.values() for r in recs)
    head = ["variant", "seeds"] + ["tuned to"] * tuned + [f"final {short}",
            f"{short} at {budget / 1e6:.3g} MB" if budget else "at equal bytes",
            "reached", "steps to target",
            "MB to target"] + [f"s to target @{tag}" for tag in links] + [
            "B/step (mean)", "ratio"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    baseline = None
    for name, recs in groups.items():
        reached = [r["time_to_target"] for r in recs if r.get("time_to_target")]
        per_step = stats.mean_sd([mean_bytes_per_step(r) for r in recs])[0]
        baseline = per_step if baseline is None else baseline
        ratio = (f"{baseline / per_step:.1f}x" if per_step and baseline is not None
                 else "—")
        target_set = any(r.get("target") for r in recs)
        diverged = sum(1 for r in recs if r.get("diverged"))
        final = stats.text([_final(r, metric) for r in recs if not r.get("diverged")])
        if diverged:
            final = (f"diverged ({diverged}/{len(recs)})" if diverged == len(recs)
                     else f"{final} ({diverged} diverged)")
        chosen = sorted({tuned_text(r) for r in recs})
        cells = [f"`{name}`", str(len(recs))] + [" / ".join(chosen) or "—"] * tuned + [final,
                 stats.text([at_bytes(r, metric, budget) for r in recs]) if budget else "—",
                 f"{len(reached)}/{len(recs)}" if target_set else "—",
                 stats.text([t["step"] for t in reached]),
                 stats.text([t["gradient_bytes"] for t in reached], 1e6)]
        cells += [stats.text([t["seconds"].get(tag) for t in reached]) for tag in links]
        cells += [f"{per_step:,.0f}" if per_step is not None else "—", ratio]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def pivot(groups: dict[str, list[dict]], metric: str) -> str | None:
    """With two or more --vary axes: the final metric (mean ± sd) with the last axis as
    columns and the others as rows; None with one axis."""
    axes = next((r.get("axes") for recs in groups.values() for r in recs), None)
    if not axes or len(axes) < 2:
        return None
    rows: dict[str, dict[str, str]] = {}
    columns: list[str] = []
    for recs in groups.values():
        pairs = recs[0]["axes"]
        row = ", ".join(v for _, v in pairs[:-1])
        column = pairs[-1][1]
        columns += [column] if column not in columns else []
        diverged = sum(1 for r in recs if r.get("diverged"))
        text = stats.text([_final(r, metric) for r in recs if not r.get("diverged")])
        rows.setdefault(row, {})[column] = (text if not diverged else
                                            f"diverged ({diverged}/{len(recs)})"
                                            if diverged == len(recs)
                                            else f"{text} ({diverged} diverged)")
    short = metric.removeprefix("eval/")
    lines = [f"final {short} by {axes[-1][0]}:", "",
             "| " + " | ".join([", ".join(k for k, _ in axes[:-1])]
                               + [f"`{c}`" for c in columns]) + " |",
             "|" + "---|" * (len(columns) + 1)]
    for row, values in rows.items():
        lines.append("| " + " | ".join([f"`{row}`"] + [values.get(c, "—") for c in columns])
                     + " |")
    return "\n".join(lines)


def compute_sources(groups: dict[str, list[dict]]) -> str:
    """One line per compute source of the cells: which C their modelled seconds use."""
    sources: dict[str, list[str]] = {}
    for name, recs in groups.items():
        for source in dict.fromkeys(r.get("compute_source") or "measured" for r in recs
                                    if not r.get("diverged")):
            sources.setdefault(source, []).append(f"`{name}`")
    if not sources:
        return ""
    if len(sources) == 1:
        return f"Compute per step in the modelled seconds: {next(iter(sources))}."
    return "Compute per step in the modelled seconds:\n\n" + "\n".join(
        f"- {source}: {', '.join(names)}" for source, names in sources.items())


def write(output_dir: str, order: list[str] | None = None, title: str = "sweep",
          command: str | None = None, panel_key: str | None = None, target=None) -> str:
    """Writes report.md and the plots from the records found; returns report.md's path.
    With a `target` (target.Target: the sweep's --target), every record's time to target is
    read again from its curve, so a target changed after the cells ran is the one reported
    (a cell stopped at the old target has no point past it)."""
    records = load(output_dir)
    if target is not None:
        for one in records:
            one["target"] = str(target)
            one["time_to_target"] = record_lib.time_to_target(one["curve"], target)
    groups = by_variant(records, order)
    target_text = next((r["target"] for r in records if r.get("target")), None)
    metric = metric_of(records, target_text)
    links = sorted({tag for r in records for p in r["curve"][:1] for tag in p["seconds"]})
    where = next((r["traffic"]["where"] for r in records if r.get("traffic")), "between nodes")
    kinds = {(r.get("compute_source") or "measured").split(" ")[0] for r in records
             if not r.get("diverged")}
    compute_note = f" {kinds.pop()}" if len(kinds) == 1 else ""
    folder = os.path.join(output_dir, "plots")
    split = panels(groups, panel_key)
    styles = curve_styles(split)  # one style per curve in every figure
    keys = axis_keys(groups)
    heading = f"{title}; curves by {keys[0]}" if len(keys) == 1 else title
    made = [plot(split, metric, lambda p: p["step"], "steps",
                 os.path.join(folder, "metric_vs_steps.png"), heading, styles=styles),
            plot(split, metric, lambda p: p["gradient_bytes"],
                 f"gradient bytes sent, busiest device ({where})",
                 os.path.join(folder, "metric_vs_bytes.png"), heading, log_x=True,
                 styles=styles)]
    for tag in links:
        link = link_text(tag)
        made.append(plot(split, metric, lambda p, tag=tag: p["seconds"].get(tag),
                         f"modelled seconds at {link} (compute{compute_note} + exchange)",
                         os.path.join(folder, f"metric_vs_seconds_{tag}.png"),
                         f"{heading}; modelled seconds at {link}", log_x=True,
                         styles=styles))
    lines = [f"# {title}", ""]
    if command:
        lines += ["```", command, "```", ""]
    seeds = sorted({r["seed"] for r in records})
    lines += [f"{len(records)} cells: {len(groups)} variants x seeds {seeds}; "
              f"target: {target_text or 'none'}; bytes {where}; mean ± sample sd over seeds, "
              "time to target over the seeds that reached it.", "",
              table(groups, metric, links), "", compute_sources(groups), ""]
    crossed = pivot(groups, metric)
    if crossed:
        lines += [crossed, ""]
    lines += tuning_report.section(output_dir, order or [])
    lines += [f"![{os.path.basename(p)}](plots/{os.path.basename(p)})" for p in made]
    path = os.path.join(output_dir, "report.md")
    with open(path, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return path

