"""Every kind of finding the code can make, read off the code itself: each place that constructs a `Finding`
(`Finding(...)`, `Finding.serving(...)`, `Finding.localization(...)` or a name bound to one of them) in the
product's packages, as a kind `(module, component, place)`:

- `module`: the producer's file, relative to the repository (`dflash_audit/audit/static_spec.py`);
- `component`: the literal component it names (both of `"fc_dims" if fc else "architecture"`), `serving` for the
  serving findings, or `*` where the component is a value (a table's, a variant's);
- `place`: a live localization's kind (`input`, `module`, `tie`, ...) where the site makes one, else `""`.

`tests/test_every_finding.py` makes a real instance of each kind reach the three reports from the CLI; a kind this
scan finds that no case makes fails it (`uncovered`). While the cases run, `recording_origins` marks every finding
made with the producer file that made it, so a finding read back from a report names its kind (`kind_of`).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
# The packages that make findings: the audit and its verbs, the catalogue, the serving engines' rules.
PRODUCER_ROOTS = ("dflash_audit", "catalogue", "serving_engines")
CONSTRUCTORS = {"Finding": "", "Finding.serving": "serving", "Finding.localization": "localization"}
ANY = "*"


class Kind(NamedTuple):
    module: str
    component: str
    place: str = ""


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Names bound to a constructor in a module (`localized = Finding.localization`)."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = ast.unparse(node.value)
            if value in CONSTRUCTORS:
                found[node.targets[0].id] = value
    return found


def _literals(node: ast.AST | None) -> list[str]:
    """The string literals an argument can be (`"a" if x else "b"`: both), or [] for a computed value."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        body, orelse = _literals(node.body), _literals(node.orelse)
        return body + orelse if body and orelse else []
    return []


def _argument(call: ast.Call, position: int, name: str) -> ast.AST | None:
    if len(call.args) > position:
        return call.args[position]
    return next((k.value for k in call.keywords if k.arg == name), None)


def kinds_in(path: Path, root: Path = REPO) -> set[Kind]:
    """The kinds of finding one source file makes."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {**{c: c for c in CONSTRUCTORS}, **_aliases(tree)}
    module = path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()
    if module == "catalogue/findings.py":  # the constructors themselves
        return set()
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        called = names.get(ast.unparse(node.func))
        if called is None:
            continue
        how = CONSTRUCTORS[called]
        if how == "serving":
            found.add(Kind(module, "serving"))
        elif how == "localization":
            for place in _literals(_argument(node, 0, "kind")) or [ANY]:
                found.add(Kind(module, "serving", place))
        else:
            for component in _literals(_argument(node, 0, "component")) or [ANY]:
                found.add(Kind(module, component))
    return found


def source_files(roots: Iterable[str] = PRODUCER_ROOTS, root: Path = REPO) -> Iterator[Path]:
    for name in roots:
        yield from sorted((root / name).rglob("*.py"))


def finding_kinds(files: Iterable[Path] | None = None, root: Path = REPO) -> set[Kind]:
    """Every kind the product's code makes (or that of `files`)."""
    return set().union(*(kinds_in(path, root) for path in (files if files is not None else source_files(root=root))))


def kind_of(finding, literal: set[Kind]) -> Kind:
    """The kind a finding made while `recording_origins` was on belongs to: its producer's literal kind when the
    code names that component (or place), else the producer's computed one (`*`)."""
    module = finding.__dict__.get("_origin", "?")
    place = finding.localized.get("kind", "") if finding.component == "serving" and finding.localized else ""
    exact = Kind(module, finding.component, place)
    if exact in literal:
        return exact
    return Kind(module, "serving", ANY) if place else Kind(module, ANY)


def uncovered(kinds: set[Kind], reached: set[Kind]) -> set[Kind]:
    """The kinds of the code no case made reach the reports."""
    return kinds - reached


@contextmanager
def recording_origins():
    """Every `Finding` constructed inside marked with the producer file that constructed it (the first caller
    outside the catalogue's constructors and dataclasses' own machinery); a copy (`dataclasses.replace`) keeps its
    original's producer."""
    from catalogue import findings

    original = findings.Finding.__post_init__
    skipped = (str(REPO / "catalogue" / "findings.py"), "dataclasses.py")

    def marked(self) -> None:
        original(self)
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.endswith(skipped)
                                     or frame.f_code.co_filename.startswith("<")):
            copied = frame.f_locals.get("obj") if frame.f_code.co_filename.endswith("dataclasses.py") else None
            if isinstance(copied, findings.Finding) and "_origin" in copied.__dict__:
                self.__dict__["_origin"] = copied.__dict__["_origin"]  # `dataclasses.replace`: the copy's maker's
                return
            frame = frame.f_back
        where = Path(frame.f_code.co_filename) if frame is not None else Path("?")
        self.__dict__["_origin"] = where.relative_to(REPO).as_posix() if where.is_relative_to(REPO) else str(where)

    findings.Finding.__post_init__ = marked
    try:
        yield
    finally:
        findings.Finding.__post_init__ = original
