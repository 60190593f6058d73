"""`dflash-audit trace -- COMMAND`: record a team's own training step, or its own evaluation, and audit it. Its flags
are `TraceFlags`, handed to `run_trace` whole."""

from __future__ import annotations

import typer

from dflash_audit.commands import VERBS
from dflash_audit.flags import register_verb
from dflash_audit.flags.trace import TraceFlags


def trace(flags: TraceFlags) -> int:
    from dflash_audit.trace.report import terminal_summary
    from dflash_audit.trace.verb import run_trace

    report = run_trace(flags)
    if hasattr(report, "summary"):  # an evaluation's report (dflash_audit/trace/evaluation/audit.py)
        typer.echo(report.summary())
        return report.exit_status
    typer.echo(terminal_summary(report))
    return report.exit_status


def register(app: typer.Typer) -> None:
    register_verb(app, "trace", VERBS["trace"], TraceFlags, trace)
