"""Everything one comparison produced, in one object the three report writers read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from catalogue.findings import Finding, FindingsReport, sort_findings
from dflash_audit.audit.sides import Side
from dflash_audit.audit.static import StaticAudit


@dataclass
class AuditReport(FindingsReport):
    ours: Side
    ref: Side
    static: StaticAudit
    dynamic: Any = None  # dflash_audit.audit.dynamic.DynamicAudit when a target was given
    notes: list[str] = field(default_factory=list)  # e.g. why the dynamic audit was skipped
    # `compare --serve`: {"ours"|"ref": {engine: serve-check report dict}} (dflash_audit/audit/serving.py)
    serving: dict[str, dict[str, Any]] | None = None

    @property
    def findings(self) -> list[Finding]:
        extra = self.dynamic.findings if self.dynamic is not None else []
        return sort_findings(self.static.findings + extra)

    @property
    def serving_divergences(self) -> int:
        """`--serve` (and `--live`): serving divergences of either drafter on any engine, counted as `serve-check`
        counts them (a drafter an engine will not serve as trained diverges from what was audited)."""
        return sum(divergence_count(section) for section in (self.serving or {}).values())

    @property
    def other_divergences(self) -> int:
        """The exit status counts the audit's own divergences, and with `--serve` the serving ones."""
        return self.serving_divergences


def divergence_count(section: dict[str, dict[str, Any]]) -> int:
    """Serving divergences in a section as written (`section_dict`, with `--live`'s findings joined): the count
    `serve-check` and `compare --serve` exit 1 on."""
    return sum(f["severity"] == "divergence" for report in section.values() for f in report.get("findings", []))
