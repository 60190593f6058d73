"""`dflash-audit`: compare, eval, train, convert, demo, serve-check, trace; `--version`.

Exit status like diff(1): 0 no divergence, 1 divergences, 2 trouble (bad input, usage)
with a one-line error; `--debug` prints the traceback above it (same exit status).
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

import typer
from typer.core import TyperCommand, TyperGroup

from dflash_audit.commands import VERBS, module_of
from dflash_audit.faults import clean, os_fault, unforeseen
from foundation.atomic import OutputError
from foundation.errors import NAME_ESCAPES, AuditError, CheckpointError, printable
from foundation.packages import PACKAGES, installed_version
from impl.spec import SpecError


class LazyVerbs(TyperGroup):
    """The verbs, each imported only when it runs: listing them (`--help`) reads `VERBS`, and `--version` needs
    none, so neither imports torch or a verb's modules."""

    def __init__(self, **attrs):
        super().__init__(**attrs)
        self.loaded: dict[str, TyperCommand] = {}
        self.listing = False
        for verb, summary in VERBS.items():  # what `--help` and "did you mean" see
            self.commands[verb] = TyperCommand(verb, help=summary)

    def format_help(self, ctx: typer.Context, formatter) -> None:
        self.listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self.listing = False

    def get_command(self, ctx: typer.Context, name: str) -> TyperCommand | None:
        if name not in VERBS or self.listing:
            return self.commands.get(name)
        if name not in self.loaded:
            self.loaded[name] = load_verb(name)
        return self.loaded[name]


app = typer.Typer(cls=LazyVerbs, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Reference-parity audit and conformance harness for DFlash drafters.")


def load_verb(verb: str) -> TyperCommand:
    """The verb's command, from its module's `register(app)`; a module that fails to import gives a command that
    answers every call with that failure (exit 2), so the verb never vanishes from the CLI."""
    single = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    module_name = module_of(verb)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 -- any import failure is reported when the verb is used
        register_unloadable(single, verb, f"{module_name} failed to import ("
                                          f"{one_line(str(exc))[:300]})")
    else:
        module.register(single)
    return typer.main.get_command(single)


def register_unloadable(app: typer.Typer, verb: str, reason: str) -> None:
    @app.command(verb, help=f"(cannot run: {reason})", add_help_option=False,
                 context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
    def unloadable(ctx: typer.Context) -> None:
        raise AuditError(f"the {verb} command cannot run: {reason}; reinstall with `make setup`")


def version_text() -> str:
    """The tool's version and every package of foundation/packages.py, one per line."""
    lines = []
    for package in PACKAGES:
        found = installed_version(package.distribution) or "not installed"
        note = "" if package.role in ("tool", "runtime") else package.role
        if package.pinned and found != package.pinned:
            note += f"; written against {package.pinned}"
        lines.append(f"{package.name} {found}" + (f" ({note})" if note else ""))
    return "\n".join(lines)


def print_version(value: bool) -> None:
    if value:
        print(version_text())
        raise typer.Exit(0)


@app.callback()
def root(version: bool = typer.Option(False, "--version", is_eager=True, callback=print_version,
                                      help="print the versions of the tool and of every package it holds drafters to")
         ) -> None:
    """Reference-parity audit and conformance harness for DFlash drafters."""


EXPECTED_ERRORS = (AuditError, CheckpointError, SpecError, OutputError)


def one_line(text: str) -> str:
    return " ".join(text.split())




def error_prefix() -> str:
    """`dflash-audit: error: `, naming the rank under torchrun (every rank prints its own error)."""
    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    return "dflash-audit: error: " if world == "1" else f"dflash-audit: error: [rank {rank}/{world}] "


def error_message(exc: BaseException) -> str:
    """The one-line message for a failure; empty messages (e.g. no command given) get one."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "NoArgsIsHelpError" in names:
        return f"no command given; one of {', '.join(VERBS)} (see the usage above)"
    if isinstance(exc, EXPECTED_ERRORS):
        return clean(str(exc)) or "bad input (rerun with --debug for the details)"
    if "ClickException" in names:
        return clean(exc.format_message()) or "bad usage (see --help)"
    return os_fault(exc) or unforeseen(exc)


def check_arguments(argv: list[str]) -> None:
    """Values no flag can take, refused before a flag reads them: an empty one (`--ours ''` is the current
    folder to pathlib). A file name that is not UTF-8 (Linux allows any bytes) is read as it is, and shown escaped
    (`printable`) wherever the tool writes it."""
    for index, value in enumerate(argv):
        flag, _, inline = value.partition("=") if value.startswith("--") else ("", "", "")
        if value == "" or (flag and _ and inline == ""):
            named = flag or (argv[index - 1] if index and argv[index - 1].startswith("-") else "an argument")
            raise AuditError(f"{named}: an empty value; give a path or value")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own = argv[:argv.index("--")] if "--" in argv else argv  # after `--`: a traced command's own arguments
    debug = "--debug" in own
    if debug:
        argv.remove("--debug")
        own = argv[:argv.index("--")] if "--" in argv else argv
    for stream in (sys.stdout, sys.stderr):  # a file name that is not UTF-8, printed, shows as \xNN
        if callable(getattr(stream, "reconfigure", None)):
            stream.reconfigure(errors=NAME_ESCAPES)
    try:
        check_arguments(own)
        result = app(args=argv, prog_name="dflash-audit", standalone_mode=False)
    except typer.Exit as exc:
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 -- every failure is exit 2 with one line
        # typer >= 0.29 raises its own vendored click's exceptions: match by name, not class.
        if "Abort" in {cls.__name__ for cls in type(exc).__mro__}:
            return 130
        if debug:  # the traceback, then the same one-line answer and the same exit status
            traceback.print_exc(file=sys.stderr)
        proposal = getattr(exc, "proposal", None)
        if proposal:  # a key map for names no known scheme fits: on stdout, ready to save
            print(proposal, end="")
        print(printable(f"{error_prefix()}{error_message(exc)}"), file=sys.stderr)
        return getattr(exc, "exit_status", 2)  # 2, or 128 + N for a run stopped by signal N (trace)
    return int(result or 0)


def entry_point() -> None:
    sys.exit(main())


if __name__ == "__main__":  # `python -m dflash_audit.cli`, e.g. under `torchrun -m dflash_audit.cli`
    entry_point()
