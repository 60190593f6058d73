"""`dflash-audit serve-check --drafter PATH [--engine vllm,sglang] [--target DIR] [--spec KEY=VALUE ...]
[--json FILE] [--out DIR] [--live [--prompts F] [--max-new-tokens N] [--vllm-python PATH]]`: will the drafter serve
as trained? `--live` also runs it in a real engine (serving_engines/live/, dflash_audit/audit/live_check.py).
Exit 0 none, 1 divergences, 2 trouble. Its flags are `ServeCheckFlags`, handed to `run_serve_check` whole."""

from __future__ import annotations

import typer

from dflash_audit.commands import VERBS
from dflash_audit.flags import register_verb
from dflash_audit.flags.serve_check import ServeCheckFlags


def serve_check(flags: ServeCheckFlags) -> int:
    from dflash_audit.audit.serving import run_serve_check

    return run_serve_check(flags)


def register(app: typer.Typer) -> None:
    register_verb(app, "serve-check", VERBS["serve-check"], ServeCheckFlags, serve_check)
