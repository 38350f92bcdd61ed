"""What a finished cell leaves: one JSON record, from its RunResult.

Per eval point (the history's records that evaluated, step s):

    gradient_bytes(s) = n(s) * G      G: the busiest device's gradient bytes per counted
                                      step between nodes (summary.json link_model/tiers;
                                      with one node, every device's bytes per step);
                                      n(s) = the method's `counted_steps(s)` (s for every
                                      synchronous method, floor(s / H) for local SGD and
                                      DiLoCo, a fragment-weighted count for Streaming
                                      DiLoCo: aggregation/base.py)
    state_bytes(s)    = s * S         S: the state bytes (metrics, batch-norm statistics)
                                      per step, which every step moves
    seconds[link](s)  = s * C + n(s) * X[link]
                                      C: the measured compute per step (link_model.py: the
                                      median step less the exchange timed alone), X: the
                                      modelled exchange of a counted step on the link, no
                                      overlap (for local methods the few state bytes of a
                                      step that does not sync are not charged)

and the eval metrics there. Time to target: the first eval point where the target holds
(its step, gradient bytes and seconds per link), None if none does. A cell whose loss
became NaN or infinite has `diverged` (the reason) and the evals made before it. Bytes that cannot
be modelled (a method whose counted step mixes kinds, `counted_steps` None) are None.
"""

from __future__ import annotations

import json
import os


def traffic_of(summary: dict) -> dict:
    """{"where", "gradient_bytes_per_step", "state_bytes_per_step", "nodes"} of a summary."""
    tiers = summary["link_model"]["tiers"]
    nodes = tiers["nodes"]
    tier = tiers["between"] if nodes > 1 else tiers["within"]
    return {"where": "between nodes" if nodes > 1 else "per device (one node)",
            "nodes": nodes,
            "gradient_bytes_per_step": tier["gradient"]["bytes_per_device"],
            "state_bytes_per_step": tier["state"]["bytes_per_device"]}


def curve_of(result, counted_steps) -> list[dict]:
    """The eval points of a RunResult (the module's top), in step order."""
    summary = result.summary
    traffic = traffic_of(summary)
    link = summary["link_model"]
    compute = link["compute_seconds"] or 0.0
    points = {}
    for rec in result.history.records:
        if "eval/loss" in rec:
            points[rec["step"]] = {k: v for k, v in rec.items() if k.startswith("eval/")}
    final = summary["final_step"]
    if final not in points and summary.get("eval_metrics"):
        points[final] = {f"eval/{k}": v for k, v in summary["eval_metrics"].items()}
    curve = []
    for step in sorted(points):
        n = counted_steps(step)
        point = {"step": step, **points[step],
                 "gradient_bytes": None if n is None else n * traffic["gradient_bytes_per_step"],
                 "state_bytes": step * traffic["state_bytes_per_step"],
                 "seconds": {tag: None if n is None else step * compute
                             + n * figures["exchange_seconds"]
                             for tag, figures in link["links"].items()}}
        curve.append(point)
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


def record_of(cell, result, aggregation, target) -> dict:
    summary = result.summary
    curve = curve_of(result, aggregation.counted_steps)
    return {"cell": cell.name, "variant": cell.variant.name, "varied": cell.variant.varied,
            "axes": [list(pair) for pair in cell.variant.axes],
            "seed": cell.seed, "final_step": summary["final_step"],
            "stopped_by": summary["stopped_by"],
            "eval": summary["eval_metrics"],
            "traffic": traffic_of(summary),
            "compute_seconds": summary["link_model"]["compute_seconds"],
            "compression_ratio_between": summary["link_model"]["tiers"][
                "compression_ratio_between"],
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
            "final_step": None, "stopped_by": None, "eval": None, "traffic": None,
            "compute_seconds": None, "compression_ratio_between": None, "curve": curve,
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
