"""Which curves share a panel of a sweep's plots, and in which style (report.py draws them).

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

import math

from mgloop.errors import ConfigError
from mgloop.observe import link_model, plots

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



def tuned_text(rec: dict) -> str:
    """"learning_rate=0.01, aggregation.outer_lr=0.5": the values a cell was tuned to."""
    return ", ".join(f"{k}={v}" for k, v in (rec.get("tuned") or {}).items())


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
