"""The packages import one way: dflash_audit → conformance → reference_adapters | held → dflash_world → impl.

A module may import its own package and any package below it, never one above or beside it
(`held`, the third-party codebases under test, sits beside `reference_adapters`: neither imports the other). The check
parses every module's imports (function-level ones too), so a back edge fails here, in CI.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Lowest first. `dflash_world` (the tiny trained target the demo and the tests run on) needs only impl.
# `held` (SpecForge and other codebases held to the references, and the serving engines in held/serving/)
# shares reference_adapters' rank.
LAYERS = (("impl",), ("dflash_world",), ("reference_adapters", "held"), ("conformance",), ("dflash_audit",))
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def imported_packages(source: str, filename: str = "<module>") -> list[tuple[int, str]]:
    """(line, top-level package) of every absolute import in `source`."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def back_edges(sources: dict[str, str]) -> list[str]:
    """`path:line: pkg imports higher` for each import that points up the layers or sideways."""
    edges = []
    for path, source in sorted(sources.items()):
        own = path.split("/")[0]
        for line, package in imported_packages(source, path):
            if package in RANK and package != own and RANK[package] >= RANK[own]:
                edges.append(f"{path}:{line}: {own} imports {package}")
    return edges


def repo_sources() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for layer in RANK for p in (REPO / layer).rglob("*.py")}


def test_every_import_points_down_the_layers():
    sources = repo_sources()
    assert len(sources) > 50  # the packages were found
    assert back_edges(sources) == []


@pytest.mark.parametrize("path, source", [
    ("impl/model.py", "from dflash_audit.errors import AuditError\n"),
    ("reference_adapters/zlab_adapter.py", "def f():\n    import conformance.comparator\n"),
    ("dflash_world/target_training.py", "import reference_adapters\n"),
    ("conformance/comparator.py", "from dflash_audit.formats import load_any\n"),
    ("held/specforge.py", "import reference_adapters.version_guard\n"),
    ("reference_adapters/speculators_adapter.py", "from held.specforge import SpecForgeImplementation\n"),
    ("held/specforge.py", "from conformance.comparator import Comparator\n"),
    # The serving engines (held/serving/) hold drafters to vLLM and SGLang: no reference, no audit above them.
    ("held/serving/verdict.py", "from dflash_audit.formats import load_any\n"),
    ("held/serving/vllm_engine.py", "import reference_adapters.speculators_adapter\n"),
    ("reference_adapters/zlab_adapter.py", "from held.serving import resolve\n"),
])
def test_a_deliberate_back_edge_fails_the_check(path, source):
    sources = repo_sources()
    sources[path] = sources.get(path, "") + source
    edges = back_edges(sources)
    assert len(edges) == 1 and edges[0].startswith(path)
