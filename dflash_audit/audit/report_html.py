"""`index.html`: one self-contained page (inline CSS, inline SVG, no network), rendered with jinja2.

Autoescape is on for everything: paths, prompt ids and messages are user-controlled.
Chart geometry is computed here; the template only draws rectangles and labels.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape

from dflash_audit.audit.report import AuditReport
from dflash_audit.audit.report_json import report_dict
from foundation.atomic import atomic_write_text

COLORS = {"ours": "#d9534f", "ref": "#2b7bb9", "served": "#7a4bb9", "audited": "#3a9a5b", "target": "#8a94a6"}


@dataclass
class Bar:
    x: float
    y: float
    width: float
    height: float
    color: str
    title: str


@dataclass
class Chart:
    title: str
    width: int
    height: int
    bars: list[Bar]
    labels: list[tuple[float, str]]  # x, text under the axis
    y_max: float
    y_label: str
    kind: str  # css class, lets the browser test find each chart


def grouped_bars(title: str, kind: str, categories: list[str], series: dict[str, list[float]], y_label: str,
                 y_max: float | None = None, width: int = 900, height: int = 260) -> Chart:
    """Side-by-side bars (ours, ref) per category, scaled to the tallest value."""
    pad_left, pad_bottom, pad_top = 48, 48, 16
    plot_w, plot_h = width - pad_left - 8, height - pad_bottom - pad_top
    values = [v for vs in series.values() for v in vs if v is not None]
    top = y_max or max(values + [1e-9])
    slot = plot_w / max(1, len(categories))
    bar_w = slot * 0.8 / max(1, len(series))
    bars, labels = [], []
    for i, category in enumerate(categories):
        x0 = pad_left + i * slot + slot * 0.1
        for j, (name, vs) in enumerate(series.items()):
            value = vs[i] if vs[i] is not None else 0.0
            h = plot_h * value / top
            bars.append(Bar(x0 + j * bar_w, pad_top + plot_h - h, bar_w, h, COLORS[name],
                            f"{category} — {name}: {value:.3g}"))
        labels.append((pad_left + i * slot + slot / 2, category))
    return Chart(title, width, height, bars, labels, top, y_label, kind)


@dataclass
class Line:
    name: str
    color: str
    points: str  # "x,y x,y ..." for an SVG polyline
    dots: list[tuple[float, float, str]]  # x, y, title
    dashed: bool = False


@dataclass
class LineChart:
    """τ along the context: one line per source (ours, ref, served...), the target's agreement dashed on the right
    scale (0 to 100%), a vertical mark at the drafter's window, trained length and rotary end."""
    title: str
    width: int
    height: int
    lines: list[Line]
    marks: list[tuple[float, str]]  # x, label
    x_labels: list[tuple[float, str]]
    y_max: float
    y_label: str
    kind: str


def along_chart(title: str, series: dict[str, Any], kind: str = "along-chart", width: int = 900,
                height: int = 280) -> LineChart | None:
    """A line chart of τ by position bin of each source in `series` (name -> AlongContext or its dict); None when
    no source has a round."""
    pad_left, pad_right, pad_bottom, pad_top = 48, 48, 48, 16
    plot_w, plot_h = width - pad_left - pad_right, height - pad_bottom - pad_top
    data = {name: along if isinstance(along, dict) else along.to_dict() for name, along in series.items()}
    bins = [b for along in data.values() for b in along["by_position"]]
    taus = [b["tau"] for b in bins if b["tau"] is not None]
    if not taus:
        return None
    end = max(b["end"] for b in bins)
    top = max(taus + [1.0])

    def x_of(position: float) -> float:
        return pad_left + plot_w * position / end

    def y_of(value: float, scale: float) -> float:
        return pad_top + plot_h * (1 - value / scale)

    lines = []
    for name, along in data.items():
        points = [(x_of((b["start"] + b["end"]) / 2), y_of(b["tau"], top), f"{name} {b['start']}-{b['end']}: τ "
                   f"{b['tau']:.3f} over {b['rounds']} rounds") for b in along["by_position"] if b["tau"] is not None]
        lines.append(Line(name, COLORS.get(name, "#444"), " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in points),
                          points))
    agreement = next(([b for b in along["by_position"] if b["agreement"] is not None] for along in data.values()
                      if any(b["agreement"] is not None for b in along["by_position"])), [])
    if agreement:
        points = [(x_of((b["start"] + b["end"]) / 2), y_of(b["agreement"], 1.0),
                   f"target's greedy agreement {b['start']}-{b['end']}: {b['agreement']:.0%}") for b in agreement]
        lines.append(Line("target agrees (right scale, 0-100%)", COLORS["target"],
                          " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in points), points, dashed=True))
    first = next(iter(data.values()))
    sources: dict[tuple[int, str], list[str]] = {}  # each mark once, the sources it is a mark of named when not all
    for name, along in data.items():
        for at, label in (along_marks(along["marks"]) if along["marks"] else []):
            if at <= end:
                sources.setdefault((at, label), []).append(name)
    marks = [(x_of(at), label if len(names) == len(data) else f"{label} ({', '.join(names)})")
             for (at, label), names in sources.items()]
    step = max(1, len(range(0, end + 1, first["bin_tokens"])) // 12)
    x_labels = [(x_of(p), str(p)) for p in range(0, end + 1, first["bin_tokens"] * step)]
    return LineChart(title, width, height, lines, marks, x_labels, top, "τ (tokens per round)", kind)


def along_marks(marks: dict[str, Any]) -> list[tuple[int, str]]:
    from dflash_audit.tau.along_context import ContextMarks

    return ContextMarks(**marks).lines()


def along_marks_text(marks: dict[str, Any]) -> str:
    from dflash_audit.tau.along_context import ContextMarks

    return ContextMarks(**marks).describe()


def along_charts(report: AuditReport) -> list[LineChart]:
    if report.dynamic is None:
        return []
    return [chart for result in report.dynamic.methods.values() if result.along
            if (chart := along_chart(f"τ along the context — {result.label}", result.along))]


def tau_charts(report: AuditReport) -> list[Chart]:
    if report.dynamic is None:
        return []
    charts = []
    for result in report.dynamic.methods.values():
        if not result.measured:
            continue
        ids = [p.id for p in result.prompts]
        charts.append(grouped_bars(f"Per-prompt τ — {result.label}", "tau-chart", ids,
                                   {s: [getattr(p, s) for p in result.prompts] for s in ("ours", "ref")},
                                   "τ (tokens per round)"))
        block = max(result.longest.values())
        hist = {s: result.histogram(s) + [0] * (block + 1 - len(result.histogram(s))) for s in ("ours", "ref")}
        charts.append(grouped_bars(f"Acceptance-length histogram — {result.label}", "histogram",
                                   [str(k) for k in range(block + 1)], hist, "rounds"))
        rates = {s: result.position_acceptance(s) + [0.0] * (block - 1 - len(result.position_acceptance(s)))
                 for s in ("ours", "ref")}
        charts.append(grouped_bars(f"Per-position acceptance rate — {result.label}", "position-chart",
                                   [str(k) for k in range(1, block)], rates, "accepted fraction", y_max=1.0))
    return charts


def environment() -> Environment:
    env = Environment(loader=PackageLoader("dflash_audit", "templates"),
                      autoescape=select_autoescape(["html", "j2"], default=True),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["compact"] = lambda value: json.dumps(value, default=str) if not isinstance(value, str) else value
    env.globals["served_chart"] = served_chart
    env.globals["along_chart"] = along_chart  # served.html.j2: `along_chart(title, {"audited": ..., "served": ...})`
    env.globals["along_marks_text"] = along_marks_text
    return env


def served_chart(live: dict) -> Chart:
    """`serve-check --live`: per-position acceptance, served by the engine beside the audit's replay."""
    served, audited = live["per_position"]["served"], live["per_position"]["audited"]
    n = max(len(served), len(audited))
    series = {"served": served + [0.0] * (n - len(served)), "audited": audited + [0.0] * (n - len(audited))}
    return grouped_bars("Per-position acceptance — served (vLLM) vs audited", "served-position-chart",
                        [str(k) for k in range(1, n + 1)], series, "accepted fraction", y_max=1.0)


def render_html(report: AuditReport) -> str:
    data = report_dict(report)
    rows = report.static.tensor_rows
    tensor_groups = [(group, list(items)) for group, items in groupby(rows, key=lambda r: r.group)]
    return environment().get_template("report.html.j2").render(
        report=report, data=data, findings=report.findings, charts=tau_charts(report), colors=COLORS,
        along_charts=along_charts(report),
        tensor_groups=tensor_groups, dynamic=report.dynamic, serving=serving_by_drafter(report))


def serving_by_drafter(report: AuditReport) -> dict | None:
    """`compare --serve`: the serving section keyed by a label naming each drafter."""
    if report.serving is None:
        return None
    sides = {"ours": report.ours, "ref": report.ref}
    return {f"{name}: {sides[name].path}": engines for name, engines in report.serving.items()}


def write_report_html(report: AuditReport, path: str | Path) -> None:
    atomic_write_text(Path(path), render_html(report))  # a file name that is not UTF-8: \xNN


def serving_page_html(drafter: str, data: dict[str, Any]) -> str:
    """`serve-check --out`'s page: the serving section of one drafter."""
    body = environment().get_template("serving.html.j2").render(serving={drafter: data})
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><meta http-equiv=\"Content-Security-"
            "Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\"><title>dflash-audit serve-check"
            "</title></head><body><main>" + body + "</main></body></html>\n")
