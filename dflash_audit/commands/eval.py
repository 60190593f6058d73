"""`dflash-audit eval`: per-prompt τ and per-round acceptance lengths of one drafter, or the τ table over benchmark
prompt sets (`--table`, ...); what it runs is `dflash_audit/audit/eval.py`. Its flags are `EvalFlags`, validated as
one model and handed down whole."""

from __future__ import annotations

import typer

from dflash_audit.commands import VERBS
from dflash_audit.flags import register_verb
from dflash_audit.flags.eval import EvalFlags


def evaluate(flags: EvalFlags) -> None:
    from dflash_audit.audit.eval import evaluate as run

    run(flags)


def register(app: typer.Typer) -> None:
    register_verb(app, "eval", VERBS["eval"], EvalFlags, evaluate)
