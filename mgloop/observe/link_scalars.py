"""The run's link report (link_report.py) as what a run writes: TensorBoard scalars
(link/...) at the end of training, and the HParams table's final metrics (final/...).

The tags are listed in summaries.py and docs/tensorboard.md; the values are those of
`link_report.report` (per step, averaged over the run's steps), None where nothing was
measured. Which compute per step the modelled times use (--compute: measured, a profile,
given) is the text `link/compute_source` of the root run.
"""

from __future__ import annotations

from mgloop.aggregation.traffic import TIERS
from mgloop.observe.link_model import parse

LINK_FIGURES = ("exchange_seconds", "exchange_seconds_slowest_step", "step_seconds_no_overlap",
                "step_seconds_overlap")  # per --link


def scalars(link_report: dict) -> dict[str, float]:
    """TensorBoard scalars of a `link_report.report`: link/compute_seconds (C of --compute:
    measured or modelled, observe/hardware.py), link/measured_compute_seconds,
    link/flops_per_example (a profile's, counted from the traced step),
    link/bytes_per_device, link/gradient_bytes_per_step, link/state_bytes_per_step,
    link/compression_ratio (of the gradients), per tier and kind the bytes and messages
    per step, and `link/<TAG>/{exchange_seconds, exchange_seconds_slowest_step,
    step_seconds_no_overlap, step_seconds_overlap}`."""
    values = {"link/bytes_per_device": float(link_report["bytes_per_device"]),
              "link/gradient_bytes_per_step": float(link_report["gradient_bytes_per_step"]),
              "link/state_bytes_per_step": float(link_report["state_bytes_per_step"])}
    tiers = link_report.get("tiers", {})
    for tier in TIERS:
        for kind, counts in tiers.get(tier, {}).items():
            values[f"link/{tier}/{kind}_bytes_per_device"] = float(counts["bytes_per_device"])
            values[f"link/{tier}/{kind}_messages_per_device"] = float(
                counts["messages_per_device"])
    if tiers.get("compression_ratio_between") is not None:
        values["link/between/compression_ratio"] = tiers["compression_ratio_between"]
    if link_report.get("compression_ratio") is not None:
        values["link/compression_ratio"] = link_report["compression_ratio"]
    if link_report["compute_seconds"] is not None:
        values["link/compute_seconds"] = link_report["compute_seconds"]
    for key in ("measured_compute_seconds", "flops_per_example"):
        if link_report.get(key) is not None:
            values[f"link/{key}"] = float(link_report[key])
    for tag, figures in link_report["links"].items():
        for key in LINK_FIGURES:
            if figures[key] is not None:
                values[f"link/{tag}/{key}"] = figures[key]
    return values


def final_metric_tags(links: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The HParams metrics (root-run scalars) of a run with these --link values."""
    tags = ["final/bytes_per_device", "final/gradient_bytes_per_step",
            "final/compression_ratio", "final/compute_seconds",
            "final/between/gradient_bytes_per_device", "final/between/compression_ratio"]
    for link in map(parse, links):
        if link.tier == "within":
            continue
        tags += [f"final/link/{link.tag}/{key}" for key in LINK_FIGURES]
    return tuple(tags)


def final_metrics(link_report: dict) -> dict[str, float | None]:
    """The values of `final_metric_tags` from a `link_report.report` (None: not measured)."""
    values = {"final/bytes_per_device": float(link_report["bytes_per_device"]),
              "final/gradient_bytes_per_step": float(link_report["gradient_bytes_per_step"]),
              "final/compression_ratio": link_report.get("compression_ratio"),
              "final/compute_seconds": link_report["compute_seconds"],
              "final/between/gradient_bytes_per_device": float(
                  link_report["tiers"]["between"]["gradient"]["bytes_per_device"]),
              "final/between/compression_ratio": link_report["tiers"][
                  "compression_ratio_between"]}
    for tag, figures in link_report["links"].items():
        for key in LINK_FIGURES:
            values[f"final/link/{tag}/{key}"] = figures[key]
    return values


def final_texts(link_report: dict) -> dict[str, str]:
    """The root run's text `link/compute_source`: which C the modelled times use
    (hardware.py)."""
    return {"link/compute_source": link_report.get("compute_source", "measured")}
