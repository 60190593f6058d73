"""data-check's three reports: the terminal table, `report.json` (schema `dflash-audit/data-check/1`, the same finding
records as compare's `dflash-audit/1`) and `index.html`, one self-contained page."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

from tabulate import tabulate

from dflash_audit.audit.report_html import environment
from dflash_audit.audit.report_json import _finite
from dflash_audit.data_check.check import DataCheckReport
from foundation.atomic import atomic_write_text
from foundation.errors import escaped
from foundation.packages import installed_versions

SCHEMA = "dflash-audit/data-check/1"


def terminal_summary(report: DataCheckReport, width: int = 70) -> str:
    rows = [[f.severity, f.component + (f":{f.key}" if f.key else ""), f"#{f.pitfall}" if f.pitfall else "",
             textwrap.fill(f.message, width)] for f in report.findings]
    lines = [tabulate(rows, headers=["severity", "finding", "pitfall", "message"], tablefmt="simple_grid")
             if rows else "no findings"]
    facts = report.facts
    lines.append(f"{facts['layout']} dataset {facts['dataset']}: {facts['records_checked']} of "
                 f"{facts['records_total']} records checked; layer ids claimed by {facts['claim']['source']}"
                 + (f": {facts['claim']['ids']}" if facts["claim"]["ids"] is not None else ""))
    if facts.get("loss_mask_coverage") is not None:
        lines.append(f"loss_mask coverage {facts['loss_mask_coverage']:.3f} (mean over the records checked)")
    lines.extend(f"note: {note}" for note in report.notes)
    count = len(report.divergences)
    lines.append(f"{count} divergence{'s' if count != 1 else ''}")
    return "\n".join(lines)


def report_dict(report: DataCheckReport) -> dict[str, Any]:
    return _finite({"schema": SCHEMA, "findings": [dict(f.to_dict(), records=f.raw.get("records", []))
                                                   for f in report.findings],
                    "facts": report.facts, "records": report.records, "notes": report.notes,
                    "versions": installed_versions(), "exit_status": report.exit_status})


def write_report_json(report: DataCheckReport, path: Path) -> dict[str, Any]:
    data = report_dict(report)
    text = json.dumps(escaped(data), indent=2, default=str) + "\n"
    atomic_write_text(Path(path), text)
    return data


def write_report_html(report: DataCheckReport, path: Path) -> None:
    html = environment().get_template("data_check.html.j2").render(report=report)
    atomic_write_text(Path(path), html)  # record and folder names that are not UTF-8: \xNN
