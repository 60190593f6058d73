"""`dflash-audit data-check DIR --target T [--layer-ids IDS | --drafter D]`: an offline hidden-state dataset (vLLM's
extract_hidden_states, speculators' hs_i.safetensors, SpecForge's pickled records) named by value against the target
recomputed on its own token ids (dflash_audit/data_check/). Exit 0 none, 1 divergences, 2 trouble. Its flags are
`DataCheckFlags` (dflash_audit/flags/data_check.py), handed to `run_data_check` whole."""

from __future__ import annotations

import typer

from dflash_audit.commands import VERBS
from dflash_audit.flags import register_verb
from dflash_audit.flags.data_check import DataCheckFlags


def data_check(flags: DataCheckFlags) -> int:
    from dflash_audit.data_check.report import terminal_summary
    from dflash_audit.data_check.run import run_data_check

    report = run_data_check(flags)
    typer.echo(terminal_summary(report))
    return report.exit_status


def register(app: typer.Typer) -> None:
    register_verb(app, "data-check", VERBS["data-check"], DataCheckFlags, data_check)
