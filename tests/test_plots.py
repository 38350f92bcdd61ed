"""The study plots (observe/plots.py, runs/sweep/report.py): from hand-made records, no
training; assertions on the matplotlib Figures' artists."""

import math

import pytest
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure

from mgloop.observe import plots
from mgloop.runs.sweep import plan as plan_lib
from mgloop.runs.sweep import plot_panels
from mgloop.runs.sweep import record
from mgloop.runs.sweep import report

LINKS = ("between_1gbit_1us", "between_100mbit_50us")


def _recs(name, axes, level=1.0, bytes_per_step=100, seeds=(0, 1, 2), steps=(2, 4, 6),
          tuned=None, bad=None):
    """Records of one variant: loss level + 1/s + 0.1 seed; `bad` {seed: "diverged" (a
    record marked diverged, its evals up to step 4, no bytes) or "nan" (a NaN at step 6)}."""
    out = []
    for seed in seeds:
        how = (bad or {}).get(seed)
        kept = [s for s in steps if s <= 4] if how == "diverged" else steps
        curve = [{"step": s, "eval/loss": level + 1 / s + 0.1 * seed,
                  "gradient_bytes": None if how == "diverged" else bytes_per_step * s,
                  "state_bytes": 0,
                  "seconds": {} if how == "diverged" else {t: 0.01 * s for t in LINKS}}
                 for s in kept]
        if how == "nan":
            curve[-1]["eval/loss"] = math.nan
        rec = {"variant": name, "seed": seed, "axes": axes, "tuned": tuned or {},
               "curve": curve, "traffic": {"where": "between nodes"}, "target": None,
               "time_to_target": None}
        if how == "diverged":
            rec["diverged"] = "the training loss is nan in steps 5..6"
        out.append(rec)
    return out


def _one_axis(specs):
    return {f"aggregation={s}": _recs(f"aggregation={s}", [["aggregation", s]], level=i)
            for i, s in enumerate(specs)}


def _legend(axes) -> dict:
    """{legend text: its handle} of a panel."""
    legend = axes.get_legend()
    return {t.get_text(): h for t, h in zip(legend.get_texts(), legend.legend_handles)}


def _panels_of(fig) -> dict:
    return {axes.get_title(): axes for axes in fig.axes}


# grid order interleaves the families; the panels do not
GRID = ["topk:ratio=0.01", "diloco:period=4", "ring", "ps_cpu", "localsgd:period=4",
        "diloco:period=8", "powersgd:rank=2", "streaming_diloco:period=4,fragments=2",
        "diloco:period=16", "sparta_diloco:period=4", "diloco:period=32", "median"]


def test_panels_group_by_family_with_the_baseline_in_each():
    """One panel per family in FAMILIES' order, not the grid's; a family of 7 local-update
    variants in two panels of at most 6, one method's variants together; `ring` the
    baseline, first in every panel; a tied axis names the method too."""
    split = plot_panels.panels(_one_axis(GRID))
    assert list(split) == ["dense", "local updates (1/2)", "local updates (2/2)",
                           "compressed every step", "robust"]
    assert all(list(curves)[0] == "ring (baseline)" for curves in split.values())
    assert all(len(curves) - 1 <= plot_panels.MAX_CURVES for curves in split.values())
    assert list(split["dense"]) == ["ring (baseline)", "ps_cpu"]
    assert list(split["compressed every step"])[1:] == ["topk:ratio=0.01", "powersgd:rank=2"]
    local = list(split["local updates (1/2)"])[1:] + list(split["local updates (2/2)"])[1:]
    assert local == ["diloco:period=4", "diloco:period=8", "diloco:period=16",
                     "diloco:period=32", "localsgd:period=4",
                     "streaming_diloco:period=4,fragments=2", "sparta_diloco:period=4"]
    assert list(split["local updates (1/2)"])[1:] == local[:4]  # cut after the diloco's
    # no ring: the first dense variant is the baseline; at most 6 besides it: one panel
    few = plot_panels.panels(_one_axis(["diloco:period=4", "ps_cpu", "topk:ratio=0.01"]))
    assert list(few) == ["local updates, compressed every step"]  # the curves studied
    assert list(few[list(few)[0]]) == ["ps_cpu (baseline)", "diloco:period=4",
                                       "topk:ratio=0.01"]
    tied = {f"aggregation/optimizer={s}/adam": _recs(s, [["aggregation/optimizer",
                                                           f"{s}/adam"]])
            for s in ("diloco:period=4", "sparseloco:period=4")}
    assert [plot_panels.family_of(plot_panels.method_of(recs[0])) for recs in tied.values()] == [
        "local updates", "sparse averaging"]
    assert plot_panels.baseline(tied) is None
    # with a KEY: the baseline's label (the other axes' values) first in each panel
    crossed = {f"aggregation={a},nodes={n}": _recs("x", [["aggregation", a], ["nodes", n]])
               for a in ("topk:ratio=0.01", "ring", "median") for n in ("2", "4")}
    by_nodes = plot_panels.panels(crossed, "nodes")
    assert list(by_nodes) == ["nodes=2", "nodes=4"]
    assert all(list(c) == ["aggregation=ring (baseline)", "aggregation=topk:ratio=0.01",
                           "aggregation=median"] for c in by_nodes.values())
    assert not any("baseline" in label for c in plot_panels.panels(crossed, "aggregation").values()
                   for label in c)


def test_a_curve_keeps_its_colour_in_every_panel_and_figure():
    """The baseline black in every panel; every other variant one colour and line style,
    the same in the steps and the bytes figure; with a KEY, one label (one attack) the
    same colour in every panel though its tuned values differ."""
    split = plot_panels.panels(_one_axis(GRID))
    styles = plot_panels.curve_styles(split)
    figures = [plots.figure(split, "eval/loss", lambda p: p["step"], "steps", "t",
                            styles=styles),
               plots.figure(split, "eval/loss", lambda p: p["gradient_bytes"], "bytes", "t",
                            log_x=True, styles=styles)]
    seen = {}
    for fig in figures:
        for axes in fig.axes:
            legend = _legend(axes)
            assert to_rgba(legend["ring (baseline)"].get_color()) == to_rgba("black")
            drawn = {to_rgba(line.get_color()) for line in axes.lines}
            for text, handle in legend.items():
                style = (to_rgba(handle.get_color()), handle.get_linestyle())
                assert seen.setdefault(text, style) == style
                assert style[0] in drawn  # the curve is drawn in its legend's colour
    assert len(seen) == len(GRID)
    assert len(set(seen.values())) == len(GRID)  # no two variants alike

    crossed = {}
    for agg, lr in (("median", "0.1"), ("krum:f=1", "0.01")):
        for attack, tuned in (("none", "0.1"), ("alie", "0.01")):
            name = f"aggregation={agg},attack={attack}"
            crossed[name] = _recs(name, [["aggregation", agg], ["attack", attack]],
                                  tuned={"learning_rate": tuned if agg == "median" else lr})
    by_rule = plot_panels.panels(crossed, "aggregation")
    fig = plots.figure(by_rule, "eval/loss", lambda p: p["step"], "steps", "t",
                       styles=plot_panels.curve_styles(by_rule))
    colours = [{text.split(" [")[0]: to_rgba(h.get_color()) for text, h in _legend(a).items()}
               for a in fig.axes]
    assert list(_legend(fig.axes[0])) == ["attack=none [learning_rate=0.1]",
                                          "attack=alie [learning_rate=0.01]"]
    assert colours[0] == colours[1] and len(set(colours[0].values())) == 2


def test_the_report_draws_bytes_and_seconds_on_log_axes_with_readable_links(
        tmp_path, monkeypatch):
    """report.write's figures: steps linear; bytes and seconds log (symlog when a method
    has sent 0 bytes by its first eval, the 0 kept); no raw link key in any text of a
    figure; the baseline in every panel of every figure; the legends under the x labels,
    inside the figure."""
    out = tmp_path / "study"
    groups = _one_axis(GRID)
    groups["aggregation=diloco:period=32"] = _recs(
        "aggregation=diloco:period=32", [["aggregation", "diloco:period=32"]],
        bytes_per_step=0)  # has sent nothing by any eval: x = 0
    for name, recs in groups.items():
        for rec in recs:
            record.write(str(out / "results" / plan_lib.variant_folder(name)
                             / f"seed={rec['seed']}.json"), rec)
    shown = {}

    def saved(fig, path, *args, **kwargs):
        shown[path.rsplit("/", 1)[-1]] = fig

    monkeypatch.setattr(Figure, "savefig", saved)
    report.write(str(out), [f"aggregation={s}" for s in GRID], "study")
    assert sorted(shown) == ["metric_vs_bytes.png", "metric_vs_seconds_between_100mbit_50us.png",
                             "metric_vs_seconds_between_1gbit_1us.png", "metric_vs_steps.png"]
    scales = {name: {a.get_xscale() for a in fig.axes} for name, fig in shown.items()}
    assert scales == {"metric_vs_steps.png": {"linear"}, "metric_vs_bytes.png": {"symlog"},
                      "metric_vs_seconds_between_1gbit_1us.png": {"log"},
                      "metric_vs_seconds_between_100mbit_50us.png": {"log"}}
    zero = [line for a in shown["metric_vs_bytes.png"].axes for line in a.lines
            if 0.0 in list(line.get_xdata())]
    assert zero  # the point at 0 bytes is drawn, not dropped by the log scale
    one = shown["metric_vs_seconds_between_1gbit_1us.png"]
    assert one.axes[0].get_xlabel().startswith("modelled seconds at 1 Gbit/s, 1 µs between nodes")
    assert "1 Gbit/s, 1 µs between nodes" in one.get_suptitle()
    assert "100 Mbit/s, 50 µs between nodes" in (
        shown["metric_vs_seconds_between_100mbit_50us.png"].axes[0].get_xlabel())
    for fig in shown.values():
        texts = [fig.get_suptitle()] + [t for a in fig.axes for t in
                                              [a.get_title(), a.get_xlabel(), *_legend(a)]]
        assert not [t for t in texts if any(tag in t for tag in LINKS)]
        assert all("ring (baseline)" in _legend(a) for a in fig.axes)
        fig.draw_without_rendering()  # each legend under its x label, inside the figure
        whole = fig.bbox
        for axes in fig.axes:
            box = axes.get_legend().get_window_extent()
            assert box.y1 <= axes.xaxis.label.get_window_extent().y0
            assert whole.x0 <= box.x0 and box.x1 <= whole.x1 and whole.y0 <= box.y0
    text = (out / "report.md").read_text()
    assert "metric_vs_seconds_between_1gbit_1us.png" in text  # the file names stay


def test_link_text_reads_the_tags_back():
    assert plot_panels.link_text("between_1gbit_1us") == "1 Gbit/s, 1 µs between nodes"
    assert plot_panels.link_text("between_100mbit_50us") == "100 Mbit/s, 50 µs between nodes"
    assert plot_panels.link_text("within_100gbit_2us") == "100 Gbit/s, 2 µs within a node"
    assert plot_panels.link_text("1.5gbit_s_2ms") == "1.5 Gbit/s, 2 ms"  # from 1.5gbit/s,2ms
    assert plot_panels.link_text("not_a_link") == "not_a_link"


def test_diverged_seeds_are_marked_and_never_dropped():
    """A variant with one seed marked diverged (no bytes) and one with a NaN: the line
    over the other seeds to the last step, an 'x' at each diverged seed's last finite
    eval, "(diverged: k/3 seeds)" with an 'x' in the legend; a variant whose seeds all
    diverged before any eval, and one with no point on the axis, still in the legend."""
    axes_of = lambda s: [["aggregation", s]]
    groups = {"ring": _recs("ring", axes_of("ring")),
              "topk": _recs("topk", axes_of("topk"), bad={1: "diverged"}),
              "qsgd": _recs("qsgd", axes_of("qsgd"), level=2.0, bad={0: "nan", 2: "nan"}),
              "randomk": [dict(r, curve=[]) for r in _recs("randomk", axes_of("randomk"),
                                                            bad={0: "diverged", 1: "diverged",
                                                                 2: "diverged"})],
              "signsgd": [dict(r, curve=[dict(p, gradient_bytes=None) for p in r["curve"]])
                          for r in _recs("signsgd", axes_of("signsgd"))]}
    split = plot_panels.panels(groups)
    for x_of, log_x in ((lambda p: p["step"], False), (lambda p: p["gradient_bytes"], True)):
        fig = plots.figure(split, "eval/loss", x_of, "x", "t", log_x=log_x,
                           styles=plot_panels.curve_styles(split))
        (axes,) = fig.axes
        legend = _legend(axes)
        assert list(legend) == ["ring (baseline)", "topk (diverged: 1/3 seeds)",
                                "qsgd (diverged: 2/3 seeds)",
                                "randomk (diverged: 3/3 seeds; nothing to plot)",
                                "signsgd" if not log_x else "signsgd (no points)"]
        assert [legend[t].get_marker() for t in legend] == ["None", "x", "x", "x", "None"]
        lines = {to_rgba(line.get_color()): [] for line in axes.lines}
        for line in axes.lines:
            lines[to_rgba(line.get_color())].append(line)
        topk = lines[to_rgba(legend["topk (diverged: 1/3 seeds)"].get_color())]
        mean, = [line for line in topk if line.get_marker() == "None"]
        mark, = [line for line in topk if line.get_marker() == "x"]
        assert list(mean.get_ydata()) == pytest.approx([1.6, 1.35, 1 + 1 / 6 + 0.1])
        x_last = 4 if not log_x else 400  # seed 1's record has no bytes: the line's x
        assert (list(mark.get_xdata()), list(mark.get_ydata())) == (
            [x_last], [pytest.approx(1.35)])
        qsgd = lines[to_rgba(legend["qsgd (diverged: 2/3 seeds)"].get_color())]
        mean, = [line for line in qsgd if line.get_marker() == "None"]
        mark, = [line for line in qsgd if line.get_marker() == "x"]
        assert list(mean.get_ydata()) == pytest.approx([2.6, 2.35, 2 + 1 / 6 + 0.1])
        assert list(mark.get_ydata()) == pytest.approx([2.25, 2.45])  # seeds 0, 2 at step 4
        assert "diverged seed's last finite eval" in fig.get_suptitle()
