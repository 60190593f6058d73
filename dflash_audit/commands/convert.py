"""`dflash-audit convert --from PATH --to PATH --format ours|zlab|speculators [--target DIR] [--allow-lossy] [--force]`,
or `--for vllm|sglang|llamacpp` instead of --format: the directory that engine serves as trained, verified by the
serving check. Its flags are `ConvertFlags`, handed to `run_convert` whole."""

from __future__ import annotations

import typer

from dflash_audit.commands import VERBS
from dflash_audit.flags import register_verb
from dflash_audit.flags.convert import ConvertFlags


def convert_command(flags: ConvertFlags) -> int:
    from dflash_audit.conversion import run_convert

    result = run_convert(flags)
    typer.echo(f"converted {result.source} ({result.source_format}) -> {result.destination} ({result.format})")
    for note in result.notes:
        typer.echo(f"note: {note}")
    return 0


def register(app: typer.Typer) -> None:
    register_verb(app, "convert", VERBS["convert"], ConvertFlags, convert_command)
