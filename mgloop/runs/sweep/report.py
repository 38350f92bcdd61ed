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

Plots (observe/plots.py), one PNG per x axis: the eval metric against steps (linear x),
against the gradient bytes sent (between nodes) and against the modelled seconds on each
--link (log x; plots.py keeps an x of 0 on a symlog axis), the link written out in the
label and title ("1 Gbit/s, 1 µs between nodes", `link_text`; file names keep the tag);
one curve per variant (the mean over seeds at each eval step, a band from the least to
the most seed; a diverged seed an 'x' at its last finite eval, its variant's legend entry
"(diverged: k/n seeds)", a variant with nothing to draw still in the legend), as small
multiples (`panels`):

  * one panel, when it holds at most MAX_CURVES curves besides the baseline;
  * else, with one --vary axis: one panel per method family (FAMILIES: the family of
    the method the variant's aggregation spec names, the name before ':'), in FAMILIES'
    order, the variants of one method together; a family of more than MAX_CURVES
    variants in about equal runs of at most MAX_CURVES (cut between methods where one
    fits), titled "family (1/2)"; variants with no aggregation axis in equal runs of at
    most MAX_CURVES in grid order ("1 of 2");
  * with --panels=KEY, or else with two or more axes (KEY = the last): one panel per
    value of KEY (for the aggregation axis, in family order), each curve labelled by the
    other axes' values.

The baseline (`baseline`): the variant of method `ring`, else the first of the dense
family; black, labelled "(baseline)", drawn in every panel (with a KEY, each panel's
curve of the baseline's label; none when KEY is the aggregation axis). A curve has one
colour and line style in every panel and every figure of the report (`curve_styles`:
per label less its tuned values, in the order the panels first show them).
"""

from __future__ import annotations

import glob
import math
import os

from mgloop.errors import ConfigError
from mgloop.observe import link_model, plots, stats
from mgloop.observe.plots import plot
from mgloop.runs.sweep import record as record_lib
from mgloop.runs.sweep import tuning_report
from mgloop.runs.sweep.plan import TUNING

LOWER_IS_BETTER = ("loss", "perplexity")
MAX_CURVES = 6  # curves a panel holds (besides the baseline) before the plots split
# The plots' panels: each method (its registry name) in one family, in the panels' order;
# a name not listed is "other".
FAMILIES = {
    "dense": ("ring", "ps_cpu", "ps_device", "ps_spread", "collective", "reduce_broadcast",
              "nccl", "hierarchical", "colocate"),
    "local updates": ("localsgd", "diloco", "streaming_diloco", "sparta_diloco",
                      "independent"),
    "sparse averaging": ("sparseloco", "demo", "sparta"),
    "compressed every step": ("topk", "randomk", "threshold", "dgc", "qsgd", "terngrad",
                              "onebit", "signsgd", "efsignsgd", "powersgd"),
    "robust": ("median", "trimmed_mean", "krum", "multikrum", "bulyan", "geomedian",
               "centered_clipping"),
    "stale or dropped": ("delay", "drop"),
    "other": ("adasum",),
}
BASELINE_METHOD = "ring"
BASELINE_MARK = " (baseline)"


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


def tuned_text(rec: dict) -> str:
    """"learning_rate=0.01, aggregation.outer_lr=0.5": the values a cell was tuned to."""
    return ", ".join(f"{k}={v}" for k, v in (rec.get("tuned") or {}).items())


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


def axis_keys(groups: dict[str, list[dict]]) -> list[str]:
    axes = next((r["axes"] for recs in groups.values() for r in recs if r.get("axes")), [])
    return [key for key, _ in axes]


def method_of(rec: dict) -> str | None:
    """The registry name of the method a record's aggregation axis names ("diloco" of
    "diloco:period=64", also in a tied axis "aggregation/optimizer=diloco/adam"); None
    without an aggregation axis."""
    for key, value in rec.get("axes") or []:
        keys = key.split("/")
        values = value.split("/") if len(keys) > 1 else [value]
        for one, text in zip(keys, values):
            if one == "aggregation":
                return text.split(":")[0].strip()
    return None


def family_of(method: str | None) -> str | None:
    """The method's family (FAMILIES; "other" if none lists it), None for no method."""
    if method is None:
        return None
    return next((f for f, names in FAMILIES.items() if method in names), "other")


def baseline(groups: dict[str, list[dict]]) -> str | None:
    """The variant the plots draw in every panel: the first of method BASELINE_METHOD,
    else the first of the dense family; None if there is neither."""
    methods = {name: method_of(recs[0]) for name, recs in groups.items()}
    return (next((n for n, m in methods.items() if m == BASELINE_METHOD), None)
            or next((n for n, m in methods.items() if family_of(m) == "dense"), None))


def _suffix(recs: list[dict]) -> str:
    """" [learning_rate=0.01]": the values a variant was tuned to, as its label ends."""
    tuned = sorted({tuned_text(r) for r in recs} - {""})
    return f" [{' / '.join(tuned)}]" if tuned else ""


def _runs(names: list[str], methods: dict[str, str | None]) -> list[list[str]]:
    """`names` (one method's variants together) in runs of at most MAX_CURVES, about
    equal, cut between methods where a method fits in a run."""
    blocks: list[list[str]] = []
    for name in names:
        if blocks and methods[blocks[-1][0]] == methods[name]:
            blocks[-1].append(name)
        else:
            blocks.append([name])
    count = math.ceil(len(names) / MAX_CURVES)
    target = math.ceil(len(names) / count)
    runs: list[list[str]] = [[]]
    for block in blocks:
        size = math.ceil(len(block) / math.ceil(len(block) / MAX_CURVES))
        for piece in (block[i:i + size] for i in range(0, len(block), size)):
            if runs[-1] and (len(runs[-1]) + len(piece) > MAX_CURVES
                             or len(runs[-1]) >= target):
                runs.append([])
            runs[-1].extend(piece)
    return runs


def panels(groups: dict[str, list[dict]], key: str | None = None
           ) -> dict[str, dict[str, list[dict]]]:
    """{panel title: {curve label: records}} (the module's top): one panel if it holds at
    most MAX_CURVES curves besides the baseline; else, with one axis, per family of
    methods (runs of at most MAX_CURVES in grid order without an aggregation axis); with
    `key` (--panels) or two or more axes (the last), per value of that axis, labelled by
    the other axes' values. The baseline's label ends with BASELINE_MARK, and every label
    with the values the variant was tuned to."""
    keys = axis_keys(groups)
    if key is not None and key not in keys:
        raise ValueError(f"--panels={key}: not a --vary axis; one of: {', '.join(keys)}")
    if not groups:
        return {}
    base = baseline(groups)
    studied = [name for name in groups if name != base]
    if key is None and len(studied) > MAX_CURVES and len(keys) >= 2:
        key = keys[-1]
    if key is not None:
        return _panels_by(groups, key, base)

    def label(name: str) -> str:
        pairs = groups[name][0].get("axes") or []
        text = pairs[0][1] if len(pairs) == 1 else name
        return text + (BASELINE_MARK if name == base else "") + _suffix(groups[name])

    methods = {name: method_of(groups[name][0]) for name in groups}
    if len(studied) <= MAX_CURVES:
        found = [f for f in FAMILIES if any(family_of(methods[n]) == f for n in studied)]
        parts = {", ".join(found) if all(methods[n] for n in studied) else "": studied}
    else:
        first = {}  # a method's first place in the grid: its variants stay together
        for index, name in enumerate(groups):
            first.setdefault(methods[name], index)
        parts = {}
        for family in list(FAMILIES) + [None]:
            members = [n for n in studied if family_of(methods[n]) == family]
            members.sort(key=lambda n: first[methods[n]])  # stable: grid order within
            runs = _runs(members, methods) if members else []
            for index, run in enumerate(runs):
                title = family or ""
                if len(runs) > 1:
                    title = (f"{family} ({index + 1}/{len(runs)})" if family
                             else f"{index + 1} of {len(runs)}")
                parts[title] = run
    return {title: {label(n): groups[n] for n in ([base] if base else []) + names}
            for title, names in parts.items()}


def _panels_by(groups: dict[str, list[dict]], key: str, base: str | None
               ) -> dict[str, dict[str, list[dict]]]:
    """panels() with a KEY: one panel per value of the axis `key`."""
    def core(name: str) -> str:
        pairs = groups[name][0].get("axes") or []
        return ", ".join(f"{k}={v}" for k, v in pairs if k != key) or name

    aggregation = "aggregation" in key.split("/")
    mark = core(base) if base and not aggregation else None
    out: dict[str, dict[str, list[dict]]] = {}
    for name, recs in groups.items():
        value = next(v for k, v in recs[0]["axes"] if k == key)
        label = core(name) + (BASELINE_MARK if core(name) == mark else "") + _suffix(recs)
        curves = out.setdefault(f"{key}={value}", {})
        curves[label] = recs
        if core(name) == mark:  # the baseline first in its panel, drawn under the others
            out[f"{key}={value}"] = {label: recs, **curves}
    if aggregation:
        order = list(FAMILIES) + [None]
        out = dict(sorted(out.items(), key=lambda item: order.index(
            family_of(method_of(next(iter(item[1].values()))[0])))))
    return out


def curve_styles(split: dict[str, dict[str, list[dict]]]) -> dict[str, dict]:
    """{curve label: matplotlib keywords} for every figure of the report (plots.palette):
    one style per label less its tuned values, the baseline's black."""
    identity = {label: label.removesuffix(_suffix(recs))
                for curves in split.values() for label, recs in curves.items()}
    styles = plots.palette(identity.values(),
                           {key for key in identity.values() if key.endswith(BASELINE_MARK)})
    return {label: styles[key] for label, key in identity.items()}


def link_text(tag: str) -> str:
    """A link's tag as a reader reads it: "between_1gbit_1us" -> "1 Gbit/s, 1 µs between
    nodes" (link_model.Link.tag made it); the tag itself if it does not parse."""
    tier, _, rest = tag.partition("_")
    if tier not in ("within", "between"):
        tier, rest = None, tag
    bandwidth, _, latency = rest.rpartition("_")
    bandwidth = bandwidth.removesuffix("_s")  # "10gbit/s" was written "10gbit_s"
    try:
        link = link_model.parse(f"{bandwidth},{latency}")
    except ConfigError:  # a tag link_model.parse cannot read back (e.g. 1e+9bit): as it is
        return tag
    bits = link.bytes_per_second * 8
    unit, scale = next(((u, s) for u, s in (("Tbit/s", 1e12), ("Gbit/s", 1e9),
                                            ("Mbit/s", 1e6), ("kbit/s", 1e3))
                        if bits >= s), ("bit/s", 1.0))
    seconds = link.latency_seconds
    when, per = next(((u, s) for u, s in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6))
                      if seconds >= s), ("ns", 1e-9))
    where = {"between": " between nodes", "within": " within a node"}.get(tier, "")
    return f"{bits / scale:g} {unit}, {seconds / per:g} {when}{where}"


def write(output_dir: str, order: list[str] | None = None, title: str = "sweep",
          command: str | None = None, panel_key: str | None = None) -> str:
    """Writes report.md and the plots from the records found; returns report.md's path."""
    records = load(output_dir)
    groups = by_variant(records, order)
    target = next((r["target"] for r in records if r.get("target")), None)
    metric = metric_of(records, target)
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
              f"target: {target or 'none'}; bytes {where}; mean ± sample sd over seeds, "
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

