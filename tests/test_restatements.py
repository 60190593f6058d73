"""Each project-wide rule is stated in one place; these checks fail when a copy comes back.

Source-scanning checks (a rule is restated in code) parse every module of the repo, and each
is proven to catch a planted copy. Import-based checks (a table or registry) assert that every
user holds the very same object.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("impl", "dflash_world", "reference_adapters", "held", "conformance", "dflash_audit", "tests", "bench")


def repo_sources() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text(encoding="utf-8")
            for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


def _calls(node: ast.AST, name: str) -> bool:
    """Whether `node` holds a call to a function or method called `name`."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            func = sub.func
            if (isinstance(func, ast.Attribute) and func.attr == name) or (isinstance(func, ast.Name) and func.id == name):
                return True
    return False


# -- 1. JSON lines are cut at "\n" only (impl/jsonl.py) ----------------------------------------------------
def jsonl_splitlines(source: str, path: str = "<module>") -> list[str]:
    """`path:line` of each JSON parse fed by `str.splitlines()`: directly (`json.loads(t.splitlines()[i])`,
    `json_lines(t.splitlines(), ...)`) or through a loop over split lines (also via a name bound to them)."""
    found = []
    tree = ast.parse(source, path)
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        split_names = {target.id for node in ast.walk(scope) if isinstance(node, ast.Assign) and _calls(node.value, "splitlines")
                       for target in node.targets if isinstance(target, ast.Name)}

        def split_lines(expr: ast.AST) -> bool:
            return _calls(expr, "splitlines") or any(isinstance(n, ast.Name) and n.id in split_names for n in ast.walk(expr))

        for node in ast.walk(scope):
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)) and \
                    getattr(node.func, "attr", getattr(node.func, "id", None)) in ("loads", "json_lines"):
                if any(_calls(arg, "splitlines") for arg in node.args):
                    found.append(f"{path}:{node.lineno}")
            elif isinstance(node, ast.For) and split_lines(node.iter) and any(_calls(s, "loads") for s in node.body):
                found.append(f"{path}:{node.lineno}")
            elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
                element = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
                if any(split_lines(g.iter) for g in node.generators) and any(_calls(e, "loads") for e in element):
                    found.append(f"{path}:{node.lineno}")
    return sorted(set(found))


def test_no_json_lines_are_cut_with_splitlines():
    sources = repo_sources()
    assert len(sources) > 100
    assert [hit for path, source in sources.items() for hit in jsonl_splitlines(source, path)] == []


@pytest.mark.parametrize("planted", [
    "import json\ndef f(t):\n    return [json.loads(x) for x in t.splitlines()]\n",
    "import json\ndef f(t):\n    lines = t.read_text().splitlines()\n    return [json.loads(x) for x in lines]\n",
    "from impl.jsonl import json_lines\ndef f(t, p, e):\n    return list(json_lines(t.splitlines(), p, e))\n",
    "import json\ndef f(t):\n    out = []\n    for x in t.splitlines():\n        out.append(json.loads(x))\n    return out\n",
    "import json\ndef f(out):\n    return json.loads(out.strip().splitlines()[-1])\n",
])
def test_a_planted_splitlines_on_json_lines_is_caught(planted):
    assert jsonl_splitlines(planted, "impl/planted.py") != []
