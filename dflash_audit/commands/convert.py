"""`dflash-audit convert --from PATH --to PATH --format ours|zlab|speculators [--target DIR] [--allow-lossy] [--force]`,
or `--for vllm|sglang` instead of --format: the directory that engine serves as trained, verified by the serving check."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from dflash_audit.commands import VERBS


class Format(str, Enum):
    ours = "ours"
    zlab = "zlab"
    speculators = "speculators"


def convert_command(
    source: Path = typer.Option(..., "--from", help="Drafter to read (ours *.pt, z-lab or speculators directory)."),
    destination: Path = typer.Option(..., "--to", help="Where to write (a *.pt file for ours, a directory otherwise)."),
    fmt: Format = typer.Option(None, "--format", help="Destination format."),
    engine: str = typer.Option(None, "--for", help="Serving engine (vllm, sglang or llamacpp): write what it serves "
                                                   "as trained (llamacpp: DIR/drafter-<quant>.gguf)."),
    quant: str = typer.Option(None, "--quant", help="--for llamacpp: f32 (default), f16, bf16, q8_0 or q4_k_m."),
    llamacpp_bin: Path = typer.Option(None, "--llamacpp-bin", help="--for llamacpp: a folder with your own "
                                                                   "llama-server and llama-quantize."),
    target: Path = typer.Option(None, "--target", help="Target (verifier) directory; required for speculators."),
    allow_lossy: bool = typer.Option(False, "--allow-lossy", help="Convert even if the drafter would change."),
    entry: str = typer.Option(None, "--entry", help="Entry of a training dict holding the state dict."),
    key_map: Path = typer.Option(None, "--key-map", help="Parameter names: 'PATTERN => REPLACEMENT' per line."),
    spec: list[str] = typer.Option([], "--spec", help="KEY=VALUE spec/recipe field of the source (repeatable)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing drafter of the same format at --to."),
) -> int:
    from dflash_audit.conversion import run_convert
    from dflash_audit.formats import LoadOptions

    result = run_convert(source, destination, fmt.value if fmt is not None else None, engine, quant, llamacpp_bin,
                         target, allow_lossy, force, LoadOptions(entry, key_map, list(spec), flag_prefix=""))
    typer.echo(f"converted {result.source} ({result.source_format}) -> {result.destination} ({result.format})")
    for note in result.notes:
        typer.echo(f"note: {note}")
    return 0


def register(app: typer.Typer) -> None:
    app.command("convert", help=VERBS["convert"])(convert_command)
