"""`dflash-audit compare`: audit a drafter against a reference; exit status like diff(1). Its flags are
`CompareFlags`, validated as one model and handed to `run_compare` whole."""

from __future__ import annotations

import typer

from dflash_audit.commands import VERBS
from dflash_audit.flags import register_verb
from dflash_audit.flags.compare import CompareFlags


def compare(flags: CompareFlags) -> int:
    from dflash_audit.audit.compare import run_compare

    return run_compare(flags).exit_status


def register(app: typer.Typer) -> None:
    register_verb(app, "compare", VERBS["compare"], CompareFlags, compare)
