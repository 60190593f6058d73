"""The summary table `compare` prints."""

from __future__ import annotations

import textwrap

from tabulate import tabulate

from dflash_audit.audit.report import AuditReport


def terminal_summary(report: AuditReport, width: int = 60) -> str:
    rows = [[f.severity, f.component + (f":{f.key}" if f.key else ""), f"#{f.pitfall}" if f.pitfall else "",
             textwrap.fill(f.message, width)] for f in report.findings]
    lines = [tabulate(rows, headers=["severity", "finding", "pitfall", "message"], tablefmt="simple_grid")
             if rows else "no findings"]
    if report.dynamic is not None:
        for method in report.dynamic.methods.values():
            lines.append(f"{method.label}: mean τ ours {method.mean['ours']:.3f}  ref {method.mean['ref']:.3f}"
                         if method.measured else f"{method.label}: τ not measured")
        where = report.dynamic.precision
        if where:
            lines.append(f"target in {where['target_dtype']}, drafters in {where['drafter_dtype']}, on {where['device']}"
                         + (f" (target sharded: --device-map {where['device_map']})" if where.get("device_map") else ""))
        for name, row in report.dynamic.by_dtype.items():
            means = row["means"]["dflash"]
            text = "  ".join(f"{side} {means[side]:.3f}" if means[side] is not None else f"{side} not measured"
                             for side in ("ours", "ref"))
            overflow = ", ".join(f"{side} overflows ({module})" for side, module in row["overflow"].items())
            lines.append(f"DFlash τ in {name}: {text}" + (f"  {overflow}" if overflow else ""))
    lines += report.notes
    if report.serving is not None:
        from dflash_audit.commands.serve_check import terminal_section

        for side, section in report.serving.items():
            lines += [f"will {side} serve as trained?", terminal_section(section)]
    count = len(report.divergences)
    line = f"{count} divergence{'s' if count != 1 else ''}"
    if report.serving is not None:
        serving = report.serving_divergences
        line += f", {serving} serving divergence{'s' if serving != 1 else ''}"
    lines.append(line)
    return "\n".join(lines)
