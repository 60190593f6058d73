"""`dflash-audit demo`: build the embedded world once, then audit its planted-bug drafter. Its flags are
`DemoFlags`, handed to `run_demo` whole."""

from __future__ import annotations

import typer

from dflash_audit.commands import VERBS
from dflash_audit.flags import register_verb
from dflash_audit.flags.demo import DemoFlags


def demo(flags: DemoFlags) -> int:
    from dflash_audit.demo import run_demo

    run_demo(flags, trace_trainer=True)
    # Finding the planted divergences is the demo's point: compare's exit status 1 ("divergences found") is
    # success here; trouble still raises and exits 2.
    return 0


def register(app: typer.Typer) -> None:
    register_verb(app, "demo", VERBS["demo"], DemoFlags, demo)
