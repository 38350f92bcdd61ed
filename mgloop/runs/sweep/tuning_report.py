"""The report's "Tuning" section, from the tuning cells' records (results/tuning/...).

Per variant, one row per point its tuning search tried (in the order the search reached
them: the records' `tune_index`): the values tried ("—" for a key the variant does not tune), each tuning
seed's final metric, the point's score (their mean, tune.summarise) and which point was
chosen: the same function and records the runner chose with, so the section says what
the final seeds ran at. A point without a score is never chosen; a variant none of whose
points has one has no chosen point (its final seeds were refused) and says so.
"""

from __future__ import annotations

import glob
import os

from mgloop.observe import stats
from mgloop.runs.sweep import record as record_lib
from mgloop.runs.sweep import tune
from mgloop.runs.sweep.plan import TUNING


def load(output_dir: str) -> list[dict]:
    return [record_lib.read(path) for path in
            sorted(glob.glob(os.path.join(output_dir, "results", TUNING, "**", "*.json"),
                             recursive=True))]


def summaries(records: list[dict], order: list[str]) -> dict[str, dict]:
    """{variant: tune.summarise of its tuning records}, variants in `order` then by name."""
    seeds = sorted({r["seed"] for r in records})
    target = next((r["target"] for r in records if r.get("target")), None)
    points: dict[str, dict[tuple, list]] = {}
    for rec in records:  # a point's records, however its seeds' tune_index came out
        mine = points.setdefault(rec["variant"], {})
        mine.setdefault(tuple(rec["tuned"].items()), []).append(rec)
    rank = {name: i for i, name in enumerate(order)}
    out = {}
    for name in sorted(points, key=lambda n: (rank.get(n, len(rank)), n)):
        tried = sorted(points[name].items(),
                       key=lambda item: min(r.get("tune_index", 0) for r in item[1]))
        out[name] = tune.summarise([(p, sorted(rs, key=lambda r: r["seed"]))
                                    for p, rs in tried], target, seeds)
    return out


def section(output_dir: str, order: list[str]) -> list[str]:
    """The section's Markdown lines ([] without tuning records)."""
    records = load(output_dir)
    if not records:
        return []
    found = summaries(records, order)
    keys = list(dict.fromkeys(k for s in found.values() for row in s["tried"]
                              for k in row["values"]))
    first = next(iter(found.values()))
    metric = first["metric"].removeprefix("eval/")
    best = "lowest" if first["lower_is_better"] else "highest"
    # the widest limit any cell ran under (a re-run may widen further than the first)
    search = max((r["tune_search"] for r in records if r.get("tune_search")),
                 key=lambda s: (s["widen"], s.get("passes", 1)),
                 default={"search": "grid", "widen": 0})
    how = ("one axis at a time in the order given, from the middle value of each, the "
           "others at their best so far" if search["search"] == "coordinate" else
           "every point of its grid")
    if search.get("passes", 1) > 1:
        how += (f", {search['passes']} passes over the axes (each from the point the last "
                "chose)")
    if search["widen"]:
        how += (f"; an axis whose best lay at its edge got one more value a geometric step "
                f"past it, up to {search['widen']} times a side")
    lines = ["## Tuning", "",
             f"Each variant's tuning search ran first ({how}; {len(records)} tuning cells) on "
             f"the tuning seeds {first['seeds']} (the final seeds are others); a point's score "
             f"is the final eval {metric} averaged over them, {best} chosen (ties to the "
             "first); a point with a seed that diverged or reported no "
             f"{metric} has no score and is never chosen; each variant's final seeds ran at "
             "its chosen values.", "",
             "| variant | " + " | ".join(f"`{k}`" for k in keys)
             + f" | {metric} per tuning seed | score | |",
             "|" + "---|" * (len(keys) + 4)]
    for name, summary in found.items():
        for row in summary["tried"]:
            values = [row["values"].get(k, "—") for k in keys]
            per_seed = ", ".join("—" if v is None else f"{v:.4g}" for v in row["scores"])
            score = "—" if row["score"] is None else stats.text([row["score"]])
            edges = summary.get("at_edge") or {}
            edge = ("" if not edges else " (at the grid's " + ", ".join(
                f"{side} `{key}`: widen" for key, side in edges.items()) + ")")
            mark = ("**chosen**" + edge if row["values"] == summary["chosen"] else
                    "none chosen: no point has a score" if summary["chosen"] is None
                    and row is summary["tried"][0] else "")
            lines.append(f"| `{name}` | " + " | ".join(values)
                         + f" | {per_seed or '—'} | {score} | {mark} |")
    edged = [name for name, s in found.items() if s.get("at_edge")]
    lines += ["", (f"At a grid's edge: {', '.join(f'`{n}`' for n in edged)} (the best may lie "
                   "outside the grid tried; widen it on that side)." if edged else
                   "Every chosen value lies inside its grid (none at the lowest or highest "
                   "value of a numeric axis).")]
    untuned = [name for name, s in found.items()
               if any(set(row["values"]) != set(keys) for row in s["tried"])]
    if untuned:
        lines += ["", "A key marked — is not an option of that variant's method: it is not "
                  "tuned there."]
    return lines + [""]
