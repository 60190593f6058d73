"""The CLI's shell: `--version` from the one package table, every verb present even when its module is broken,
and the registries stated once (the implementations, the package versions)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import typer

from dflash_audit import cli
from foundation.packages import PACKAGES, Package, installed_version

REPO = Path(__file__).resolve().parents[1]


def test_version_names_the_tool_its_runtime_and_every_package_it_holds_others_to(capsys):
    assert cli.main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [package.name for package in PACKAGES]
    names = {package.name for package in PACKAGES}
    assert {"dflash_audit", "torch", "transformers", "speculators", "dflash", "specforge"} <= names
    for package, line in zip(PACKAGES, lines):
        assert line.split()[1] == (installed_version(package.distribution) or "not")


def test_version_says_not_installed_and_a_pin_not_met(capsys, monkeypatch):
    monkeypatch.setattr(cli, "PACKAGES", (*PACKAGES, Package("nosuch", "nosuch-engine-dist", "engine", "1.0")))
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "nosuch not installed (engine; written against 1.0)"


def test_a_verb_whose_module_fails_to_import_is_an_error_not_a_missing_command(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "dflash_audit.commands.eval", None)  # importing it now raises
    monkeypatch.setattr(cli, "app", typer.Typer(cls=cli.LazyVerbs, add_completion=False, no_args_is_help=True,
                                                pretty_exceptions_enable=False))
    cli.app.callback()(lambda: None)
    for argv in (["eval", "--drafter", "x.pt"], ["eval", "--help"], ["eval"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        assert err.startswith("dflash-audit: error: the eval command cannot run: dflash_audit.commands.eval "
                              "failed to import (import of dflash_audit.commands.eval halted")
    assert cli.main(["--help"]) == 0
    assert re.search(r"eval\s+Per-prompt", capsys.readouterr().out)  # still listed, from VERBS
    assert cli.main(["convert", "--help"]) == 0  # the other verbs still work


def test_each_verbs_help_is_its_listing():
    """A verb's own `--help` and the listing read one line (`commands.VERBS`), the listing without importing it."""
    from dflash_audit.commands import VERBS

    group = typer.main.get_command(cli.app)
    for verb, summary in VERBS.items():
        command = group.get_command(typer.Context(group), verb)
        assert command.help == summary, verb


def test_one_implementation_registry():
    """conformance's `--impl` short names are reference_adapters' table plus held/'s, imported, never restated."""
    import conformance.conftest as suite
    import held
    import reference_adapters

    assert suite.KNOWN == {**reference_adapters.IMPLEMENTATIONS, **held.HELD}
    assert suite.DEFAULT_IMPL == reference_adapters.IMPLEMENTATIONS["ours"]
    assert set(suite.REFERENCES) == set(reference_adapters.REFERENCES)
    spelled = re.compile(r"[\"'](impl|reference_adapters|held)\.[\w.]+:\w+Implementation[\"']")
    sources = [p for d in ("foundation", "impl", "reference_adapters", "held", "serving_engines", "conformance",
                           "dflash_audit", "bench")
               for p in (REPO / d).rglob("*.py")]
    where = sorted(str(p.relative_to(REPO)) for p in sources if spelled.search(p.read_text()))
    assert where == ["held/__init__.py", "reference_adapters/__init__.py"]


def test_one_package_version_table():
    """Only foundation/packages.py asks package metadata for a version; every other module reads its table."""
    asks = re.compile(r"metadata\.version\(|from importlib\.metadata import version|from importlib import metadata")
    sources = [p for d in ("foundation", "catalogue", "impl", "reference_adapters", "held", "serving_engines",
                           "conformance", "dflash_audit", "dflash_world")
               for p in (REPO / d).rglob("*.py")]
    where = sorted(str(p.relative_to(REPO)) for p in sources if asks.search(p.read_text()))
    assert where == ["foundation/packages.py"]
