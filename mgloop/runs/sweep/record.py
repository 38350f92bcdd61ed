"""What a finished cell leaves: one JSON record, from its RunResult.

Per eval point (the history's records that evaluated, step s), from the run's link
report (mgloop/observe/link_report.py: what each step s' < s moved, from the occasions
its method sends on):

    gradient_bytes(s) = the busiest device's gradient bytes sent through step s, at the
                        method's tier (between nodes; with one node, per device)
    state_bytes(s)    = the same of the state (metrics, batch-norm statistics)
    seconds[link](s)  = s * C + sum_{s' < s} X[link](s')
                        C: the run's compute per step, summary.json's
                        link_model.compute_seconds (--compute: measured, the median step
                        less the exchange timed alone, or modelled for a profile or given,
                        observe/hardware.py; `compute_source` says which), X: the modelled
                        exchange of step s' on the link, no overlap

and the eval metrics there, so gradient_bytes(S) / S at the last step S is summary.json's
link_model.gradient_bytes_per_step. Time to target: the first eval point where the target
holds (its step, gradient bytes and seconds per link), None if none does. A cell whose
loss became NaN or infinite has `diverged` (the reason) and the evals made before it.
`tuned` holds the cell's tuned settings (tune.py; {} without --tune) and `phase` whether
it is a tuning cell or a final seed; the runner adds a tuning cell's `tune_index` (its
point's place in the grid) and a final cell's `tuning` (tune.summarise: what was tried,
the scores, the choice).
"""

from __future__ import annotations

import json
import os

from mgloop.observe import link_model, link_report


def traffic_of(summary: dict) -> dict:
    """{"where", "gradient_bytes_per_step", "state_bytes_per_step", "nodes"} of a summary."""
    link = summary["link_model"]
    return {"where": link["where"], "nodes": link["tiers"]["nodes"],
            "gradient_bytes_per_step": link["gradient_bytes_per_step"],
            "state_bytes_per_step": link["state_bytes_per_step"]}


def curve_of(result) -> list[dict]:
    """The eval points of a RunResult (the module's top), in step order."""
    summary = result.summary
    link = summary["link_model"]
    compute = link["compute_seconds"] or 0.0
    points = {}
    for rec in result.history.records:
        if "eval/loss" in rec:
            points[rec["step"]] = {k: v for k, v in rec.items() if k.startswith("eval/")}
    final = summary["final_step"]
    if final not in points and summary.get("eval_metrics"):
        points[final] = {f"eval/{k}": v for k, v in summary["eval_metrics"].items()}
    if not points:
        return []
    tier = link_report.method_tier(link["tiers"]["nodes"])
    schedule = link_report.Schedule(result.trainer.aggregation.traffic, max(points))
    through = schedule.traffic_through(points)
    links = [link_model.parse(text) for text in summary["config"]["links"]]
    within = next((one for one in links if one.tier == "within"), None)
    exchanged = {one.tag: schedule.totals(points, link_report.exchange_of(one, within))
                 for one in links if one.tier != "within"}
    curve = []
    for step in sorted(points):
        curve.append({"step": step, **points[step],
                      "gradient_bytes": link_report.busiest_bytes(through[step], tier,
                                                                  "gradient"),
                      "state_bytes": link_report.busiest_bytes(through[step], tier, "state"),
                      "seconds": {tag: step * compute + totals[step]
                                  for tag, totals in exchanged.items()}})
    return curve


def time_to_target(curve: list[dict], target) -> dict | None:
    """{"step", "gradient_bytes", "seconds"} of the first point meeting `target`, else None."""
    if target is None:
        return None
    for point in curve:
        if target.met(point.get(target.key)):
            return {"step": point["step"], "gradient_bytes": point["gradient_bytes"],
                    "seconds": point["seconds"]}
    return None


def _tuned(cell) -> dict:
    """{"tuned": {key: value text} of the cell's point, "phase": "tuning" or "final"}."""
    return {"tuned": dict(cell.point), "phase": "tuning" if cell.tuning else "final"}


def record_of(cell, result, target) -> dict:
    summary = result.summary
    curve = curve_of(result)
    return {"cell": cell.name, "variant": cell.variant.name, "varied": cell.variant.varied,
            "axes": [list(pair) for pair in cell.variant.axes],
            "seed": cell.seed, **_tuned(cell), "final_step": summary["final_step"],
            "stopped_by": summary["stopped_by"],
            "eval": summary["eval_metrics"],
            "evaluated_model": summary.get("evaluated_model"),  # which model "eval" is of
            "traffic": traffic_of(summary),
            "compute_seconds": summary["link_model"]["compute_seconds"],
            "compute_source": summary["link_model"].get("compute_source", "measured"),
            "compression_ratio": summary["link_model"]["compression_ratio"],
            "curve": curve, "target": None if target is None else str(target),
            "time_to_target": time_to_target(curve, target)}


def diverged_record(cell, history, reason: str, target) -> dict:
    """The record of a cell whose loss became NaN or infinite: the evals its History
    (callbacks.py) kept before (metrics only: no traffic is known without the run's
    summary), and `diverged`, the reason."""
    curve = [{"step": rec["step"], **{k: v for k, v in rec.items() if k.startswith("eval/")},
              "gradient_bytes": None, "state_bytes": None, "seconds": {}}
             for rec in history.records if "eval/loss" in rec]
    return {"cell": cell.name, "variant": cell.variant.name, "varied": cell.variant.varied,
            "axes": [list(pair) for pair in cell.variant.axes], "seed": cell.seed,
            **_tuned(cell), "final_step": None, "stopped_by": None, "eval": None,
            "traffic": None, "compute_seconds": None, "compute_source": None,
            "compression_ratio": None, "curve": curve,
            "target": None if target is None else str(target),
            "time_to_target": time_to_target(curve, target), "diverged": reason}


def write(path: str, record: dict) -> None:
    """Atomically (summaries.write_json_atomically): a re-run sees the whole record or none."""
    from mgloop.observe import summaries
    os.makedirs(os.path.dirname(path), exist_ok=True)
    summaries.write_json_atomically(path, record)


def read(path: str) -> dict:
    with open(path) as handle:
        return json.load(handle)
