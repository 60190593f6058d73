"""`dflash-audit convert --from PATH --to PATH --format ours|zlab|speculators [--target DIR] [--allow-lossy] [--force]`,
or `--for vllm|sglang` instead of --format: the directory that engine serves as trained, verified by the serving check."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from dflash_audit.commands import VERBS
from dflash_audit.conversion import convert, convert_for
from foundation.errors import AuditError


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
    from loguru import logger

    logger.disable("speculators")  # its per-tensor INFO lines would bury the one-line result
    from dflash_audit.formats import LoadOptions

    options = LoadOptions(entry, key_map, list(spec), flag_prefix="")
    if (fmt is None) == (engine is None):
        raise AuditError("give exactly one of --format (ours, zlab, speculators) and --for (vllm, sglang, llamacpp)")
    if quant is not None and engine != "llamacpp":
        raise AuditError("--quant applies to --for llamacpp only")
    if engine == "llamacpp":
        from dflash_audit.conversion import convert_for_llamacpp

        result = convert_for_llamacpp(source, destination, target, quant or "f32", force=force, options=options,
                                      bin_dir=llamacpp_bin)
    elif engine is not None:
        result = convert_for(source, destination, engine, target=target, force=force, options=options)
    else:
        result = convert(source, destination, fmt.value, target=target, allow_lossy=allow_lossy, force=force,
                         options=options)
    typer.echo(f"converted {result.source} ({result.source_format}) -> {result.destination} ({result.format})")
    for note in result.notes:
        typer.echo(f"note: {note}")
    return 0


def register(app: typer.Typer) -> None:
    app.command("convert", help=VERBS["convert"])(convert_command)
