"""The trace's three reports: the terminal table, `report.json` (schema `dflash-audit/trace/1`, the family of
compare's `dflash-audit/1`: the same finding records) and `index.html`, one self-contained page with the recorded
data flow drawn (target layers -> fc -> draft layers -> logits -> loss), each divergent edge marked."""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tabulate import tabulate

from dflash_audit.audit.report_html import environment
from dflash_audit.audit.report_json import _finite
from dflash_audit.trace.step_audit.audit import TraceReport
from foundation.atomic import atomic_write_bytes
from foundation.packages import installed_versions

SCHEMA = "dflash-audit/trace/1"


def terminal_summary(report: TraceReport, width: int = 70) -> str:
    rows = [[f.severity, f.component + (f":{f.key}" if f.key else ""), f"#{f.pitfall}" if f.pitfall else "",
             textwrap.fill(f.message, width)] for f in report.findings]
    lines = [tabulate(rows, headers=["severity", "finding", "pitfall", "message"], tablefmt="simple_grid")
             if rows else "no findings"]
    facts = report.facts
    lines.append(f"target {facts['target']['path']} on {', '.join(facts['target']['placement'])}; drafter "
                 f"{facts['drafter']['class']} on {', '.join(facts['drafter']['placement'])}; "
                 f"{facts['steps']} step{'s' if facts['steps'] != 1 else ''} recorded in {facts['recording']}")
    lines.extend(f"note: {note}" for note in report.notes)  # what could not be known, said plainly
    count = len(report.divergences)
    lines.append(f"{count} divergence{'s' if count != 1 else ''}")
    return "\n".join(lines)


def report_dict(report: TraceReport) -> dict[str, Any]:
    return _finite({
        "schema": SCHEMA,
        "findings": [f.to_dict() for f in report.findings],
        "tensors": [asdict(row) for row in report.tensors],
        "flow": report.flow,
        "facts": report.facts,
        "versions": installed_versions(),
        "exit_status": report.exit_status,
        "notes": report.notes,
    })


def write_report_json(report: TraceReport, path: Path) -> dict[str, Any]:
    data = report_dict(report)
    text = json.dumps(data, indent=2, default=str) + "\n"
    atomic_write_bytes(Path(path), lambda tmp: Path(tmp).write_text(text))
    return data


def flow_nodes(report: TraceReport) -> list[dict[str, Any]]:
    """The boxes of the data-flow drawing, left to right, and whether the edge into each is divergent."""
    flow = report.flow
    divergent = set(flow.get("divergent", []))
    fc_layers = flow.get("fc_layers") or []
    reference = flow.get("reference_layers") or []
    return [
        {"label": "target layers", "detail": f"{flow.get('target_layers', '?')} decoder layers",
         "edge": None, "bad": False},
        {"label": "fc", "detail": f"reads {fc_layers} (reference {reference})", "edge": "target layers → fc",
         "bad": "fc" in divergent},
        {"label": "draft layers", "detail": f"{report.facts['drafter'].get('facts', {}).get('num_hidden_layers', '?')}"
                                            " layers; block tokens", "edge": "fc → draft layers",
         "bad": "block" in divergent},
        {"label": "logits", "detail": "draft logits", "edge": "draft layers → logits", "bad": False},
        {"label": "loss", "detail": f"{flow.get('loss_kind', 'kind unknown')}; weights {flow.get('weights', '?')}",
         "edge": "logits → loss", "bad": "loss" in divergent},
        {"label": "targets", "detail": f"{flow.get('targets', '?')}; shift {flow.get('target_shift', '?')}",
         "edge": "target → targets → loss", "bad": "targets" in divergent},
    ]


def write_report_html(report: TraceReport, path: Path) -> None:
    html = environment().get_template("trace.html.j2").render(report=report, data=report_dict(report),
                                                               nodes=flow_nodes(report))
    atomic_write_bytes(Path(path), lambda tmp: Path(tmp).write_text(html, encoding="utf-8"))
