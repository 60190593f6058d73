"""`report.json`, schema `dflash-audit/1` (docs/reports.md), plus extra keys the HTML report also shows."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dflash_audit.audit.report import AuditReport
from dflash_audit.audit.sides import Side
from foundation.atomic import atomic_write_bytes
from foundation.errors import escaped
from foundation.packages import installed_versions

SCHEMA = "dflash-audit/1"


def side_dict(side: Side) -> dict[str, Any]:
    """A side as read: its spec (`null` for an unknown field), where each field came from, and for a
    foreign checkpoint how it was read (entry, ignored training state, name mapping, keys not read)."""
    spec = {name: side.value(name) for name in side.provenance if not name.startswith("recipe.")} \
        if side.spec is None else side.spec.to_dict()
    data = {"path": side.path, "format": side.format, "spec": spec, "spec_complete": side.spec is not None,
            "provenance": side.provenance, "raw_target_layer_ids": side.raw_layer_ids,
            "layer_id_convention": side.layer_id_convention}
    if side.contradictions:
        data["contradictions"] = [str(c) for c in side.contradictions]
    if side.gguf:
        data["gguf"] = {k: v for k, v in side.gguf.items() if k != "metadata"}
    if side.foreign:
        data["foreign"] = side.foreign
        data["recipe_unknown"] = side.recipe_unknown
    return data


def report_dict(report: AuditReport) -> dict[str, Any]:
    data = {
        "schema": SCHEMA,
        "ours": side_dict(report.ours),
        "ref": side_dict(report.ref),
        "findings": [f.to_dict() for f in report.findings],
        "tau": report.dynamic.tau_dict() if report.dynamic is not None else None,
        "versions": installed_versions(),
        # Extra keys (allowed by the schema):
        "exit_status": report.exit_status,
        "recipes": report.static.recipes,
        "spec_diff": [dict(asdict(row), same=row.same) for row in report.static.spec_rows],
        "tensors": [asdict(row) for row in report.static.tensor_rows],
        "notes": report.notes,
    }
    if report.static.target_vocabulary is not None:
        data["target_vocabulary"] = report.static.target_vocabulary
    if report.serving is not None:
        data["serving"] = report.serving
    return _finite(data)


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every JSON parser reads the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_report_json(report: AuditReport, path: str | Path) -> dict[str, Any]:
    data = report_dict(report)
    text = json.dumps(escaped(data), indent=2, default=str) + "\n"  # a name that is not UTF-8: \\xNN
    atomic_write_bytes(Path(path), lambda tmp: Path(tmp).write_text(text))
    return data
