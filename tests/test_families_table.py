"""The families table (dflash_audit/families_readme.py): README.md and docs/families.md show the generated table,
every cell names a test that exists, and every — and n/a is what the installed codebases have."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

from dflash_audit.families_readme import FACTS, HELD, NA, NOT_HELD, TABLE, markdown

ROOT = Path(__file__).resolve().parents[1]
# Where each codebase keeps its drafters (installed package folders), and what in this repository would hold them.
SOURCES = {"z-lab": ("dflash",), "Model-Optimizer": ("modelopt/torch/speculative",), "SpecForge": ("specforge",),
           "SGLang": ("sglang/srt/speculative", "sglang/srt/models")}
HOLDERS = {"Model-Optimizer": "held/modelopt.py", "SpecForge": "held/specforge.py"}


def installed(folder: str) -> Path:
    top, _, rest = folder.partition("/")
    spec = importlib.util.find_spec(top)  # found, not imported
    return Path(list(spec.submodule_search_locations)[0]).joinpath(*rest.split("/") if rest else [])


def mentions(codebase: str, family: str) -> list[str]:
    """Files of the codebase that name the family as a word (`dspark`, `DSpark`, `DSPARK`)."""
    word = re.compile(rf"\b{family}\b", re.IGNORECASE)
    return [str(p) for folder in SOURCES[codebase] for p in installed(folder).rglob("*.py")
            if word.search(p.read_text(encoding="utf-8", errors="replace"))]


def refused_by_plug(module: str, family: str) -> bool:
    """The held plug says, in a message of its own, that it does not wrap or hold the family."""
    tree = ast.parse((ROOT / module).read_text())
    texts = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    return any(re.search(rf"\b{family}\b", text, re.IGNORECASE) and re.search(r"not (wrapped|held)", text)
               for text in texts)


def test_readme_and_docs_show_the_generated_table():
    assert markdown() in (ROOT / "README.md").read_text(), "run: python -m dflash_audit.families_readme"
    assert markdown(with_tests=True) in (ROOT / "docs" / "families.md").read_text(), \
        "run: python -m dflash_audit.families_readme"


def test_every_cell_names_a_test_that_exists():
    for family, row in TABLE.items():
        for codebase, cell in row.items():
            path, _, name = cell.test.partition("::")
            tree = ast.parse((ROOT / path).read_text())
            defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
            assert name.startswith("test_") and name in defined, f"{family} × {codebase}: {cell.test}"
            assert cell.mark in (HELD, NA, NOT_HELD)


def test_each_dash_and_na_is_what_the_installed_codebase_has():
    """n/a: no file of the codebase names the family; —: it does, and nothing here holds it (its held plug says it
    does not; for SGLang, no serving rule is the family's own)."""
    from serving_engines.rules import RULES

    checked = 0
    for family, row in TABLE.items():
        for codebase, cell in row.items():
            if cell.test != FACTS:
                continue
            found = mentions(codebase, family)
            if cell.mark == NA:
                assert found == [], f"{codebase} has {family}: {found[:3]}"
            else:
                assert cell.mark == NOT_HELD and found, f"{codebase} has no {family}"
                if codebase in HOLDERS:
                    assert refused_by_plug(HOLDERS[codebase], family), f"{HOLDERS[codebase]} seems to hold {family}"
                else:
                    assert not [r for r in RULES if r.engine == codebase.lower() and r.family == family]
            checked += 1
    assert checked == 7  # DFlash2 × 2, DSpark × 2, XPress × 3
