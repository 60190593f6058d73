"""`dflash-audit`: compare, eval, train, convert, demo.

Exit status like diff(1): 0 no divergence, 1 divergences, 2 trouble (bad input, usage)
with a one-line error; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import typer

from dflash_audit.errors import AuditError
from impl.checkpoint import CheckpointError
from impl.spec import SpecError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Reference-parity audit and conformance harness for DFlash drafters.")

# Each verb lives in dflash_audit/commands/<verb>.py and exposes `register(app)`.
VERBS = ("compare", "eval", "train", "convert", "demo")
for verb in VERBS:
    module_name = f"dflash_audit.commands.{verb}"
    if importlib.util.find_spec(module_name) is not None:
        importlib.import_module(module_name).register(app)

EXPECTED_ERRORS = (AuditError, CheckpointError, SpecError, FileNotFoundError)


def error_prefix() -> str:
    """`dflash-audit: error: `, naming the rank under torchrun (every rank prints its own error)."""
    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    return "dflash-audit: error: " if world == "1" else f"dflash-audit: error: [rank {rank}/{world}] "


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if debug:
        argv.remove("--debug")
    try:
        result = app(args=argv, prog_name="dflash-audit", standalone_mode=False)
    except EXPECTED_ERRORS as exc:
        proposal = getattr(exc, "proposal", None)
        if proposal:  # a key map for names no known scheme fits: on stdout, ready to save
            print(proposal, end="")
        if debug:
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"{error_prefix()}{message}", file=sys.stderr)
        return 2
    except typer.Exit as exc:
        return exc.exit_code
    except Exception as exc:  # click usage errors and the like
        # typer >= 0.29 raises its own vendored click's exceptions: match by name, not class.
        names = {cls.__name__ for cls in type(exc).__mro__}
        if "Abort" in names:
            return 130
        if "ClickException" in names:
            if debug:
                raise
            print(f"{error_prefix()}{' '.join(exc.format_message().split())}", file=sys.stderr)
            return 2
        if debug:
            raise
        message = " ".join(str(exc).split())[:300]
        print(f"{error_prefix()}{type(exc).__name__}: {message} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 2
    return int(result or 0)


def entry_point() -> None:
    sys.exit(main())


if __name__ == "__main__":  # `python -m dflash_audit.cli`, e.g. under `torchrun -m dflash_audit.cli`
    entry_point()
