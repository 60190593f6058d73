"""What a report must show of a finding, and a verb run from the CLI with its report object kept: the checks that
tests/test_every_finding.py and the live cases of tests/bad_inputs/test_fuzz.py hold every finding to."""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from markupsafe import escape

from catalogue.findings import Finding

GRID_EDGES = re.compile(r"^[┌├└╞]")


@dataclass
class Run:
    """One CLI run of a case: what it printed, the reports it wrote, and the findings of the report object."""
    case: str
    status: int
    terminal: str
    data: Any
    page: str
    findings: list[Finding] = field(default_factory=list)
    served: list[tuple[str, Finding]] = field(default_factory=list)  # (engine, finding) of a serving section


def squeezed(text: str) -> str:
    return "".join(text.split())


def table_cells(terminal: str) -> list[str]:
    """Each cell of every grid table the terminal shows, its wrapped lines joined (tabulate's simple_grid), and
    every plain line."""
    cells, row = [], None
    for line in terminal.splitlines():
        if "│" not in line or GRID_EDGES.match(line):
            if row:
                cells += ["".join(column) for column in row]
            row = None
            if "│" not in line:
                cells.append(line)
            continue
        parts = line.split("│")[1:-1]
        if row is None or len(row) != len(parts):
            if row:
                cells += ["".join(column) for column in row]
            row = [[] for _ in parts]
        for column, part in zip(row, parts, strict=True):
            column.append(part)
    if row:
        cells += ["".join(column) for column in row]
    return [squeezed(cell) for cell in cells]


def json_records(data: Any) -> list[dict]:
    """Every dict anywhere in a report's JSON."""
    found = []
    if isinstance(data, dict):
        found.append(data)
        for value in data.values():
            found += json_records(value)
    elif isinstance(data, list):
        for value in data:
            found += json_records(value)
    return found


def as_written(finding: Finding) -> dict:
    """The finding's one serialization as a JSON reader reads it back."""
    from dflash_audit.audit.report_json import _finite

    return json.loads(json.dumps(_finite(finding.to_dict()), default=str))


def missing_from_reports(finding: Finding, run: Run) -> list[str]:
    """Where the finding is not: `terminal`, `json` (its serialization, severity/component/key included) and
    `html` (its message escaped as the page escapes it)."""
    missing = []
    message = squeezed(finding.message)
    if not any(message in cell for cell in table_cells(run.terminal)):
        missing.append("terminal")
    written = as_written(finding)
    if not any(all(record.get(k) == v for k, v in written.items()) for record in json_records(run.data)):
        missing.append("json")
    page = squeezed(run.page)
    if squeezed(str(escape(finding.message))) not in page and squeezed(html.escape(finding.message)) not in page:
        missing.append("html")  # (markupsafe, the templates' escaping, writes ' as &#39;; html.escape as &#x27;)
    return missing


# -- the cases: each a verb on real inputs ------------------------------------------------------------------------


def cli(argv: list, capsys) -> tuple[int, str]:
    from dflash_audit.cli import main

    status = main([str(a) for a in argv])
    captured = capsys.readouterr()
    assert status in (0, 1), (argv, captured.err[-2000:])
    return status, captured.out


def captured(monkeypatch, module, name: str) -> list:
    """`module.name` wrapped so that what it returns is kept (the report object the verb built)."""
    kept = []
    original = getattr(module, name)

    def keep(*args, **kwargs):
        result = original(*args, **kwargs)
        kept.append(result)
        return result

    monkeypatch.setattr(module, name, keep)
    return kept


def section_findings(section: dict) -> list[tuple[str, Finding]]:
    """A serving section's records by engine: each engine's findings, and its live section's localizations."""
    return [(engine, f) for engine, report in section.items()
            for f in [*report.findings, *(report.live or {}).get("findings", [])]]


def serve_case(case: str, argv: list, tmp_path: Path, capsys, monkeypatch) -> Run:
    import dflash_audit.audit.serving as serving

    out = tmp_path / case
    sections = captured(monkeypatch, serving, "serving_section")
    status, terminal = cli(["serve-check", *argv, "--out", out], capsys)
    assert status in (0, 1), (case, terminal)
    (section,) = sections
    served = section_findings(section)
    return Run(case, status, terminal, json.loads((out / "serving.json").read_text()),
               (out / "index.html").read_text(), [f for _, f in served], served)


class CapturedOut:
    """What the CLI prints, read back (capsys is function-scoped; the cases run once per module)."""

    def __init__(self, monkeypatch):
        import io
        import sys

        self.out, self.err = io.StringIO(), io.StringIO()
        monkeypatch.setattr(sys, "stdout", self.out)
        monkeypatch.setattr(sys, "stderr", self.err)

    def readouterr(self):
        texts = []
        for buffer in (self.out, self.err):
            texts.append(buffer.getvalue())
            buffer.seek(0)
            buffer.truncate()
        return type("Captured", (), {"out": texts[0], "err": texts[1]})()
