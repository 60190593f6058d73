"""The packages import one way:
dflash_audit → conformance → reference_adapters | held | serving_engines → dflash_world → drafter_files → impl →
foundation | catalogue.

A module may import its own package and any package below it, never one above or beside it
(`held`, the third-party codebases under test, and `serving_engines`, vLLM and SGLang reading a drafter, sit beside
`reference_adapters`: none imports another). The check parses every module's imports (function-level ones too), so a
back edge fails here, in CI. Inside the packages no two modules import each other, however far round (no circles).

`dflash_audit` is itself layered by its sub-packages and modules (`SUBLAYERS`): the entry point, then the verbs
(`commands/`: parse flags, call one function, print), the demo and the generated pages, `trace` (a training step recorded and audited), the audit, conversion, τ and training,
the rounds core (every source of rounds held to the replay), each verb's flags declared as one model (`flags/`, which
the verbs, the audit, tests and benchmarks build), the output checks, the formats, and the shared helpers; none imports one above or beside it, so the audit never
imports a verb. Nothing but the CLI imports a verb, tests and benchmarks included: they call what the verb runs.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Lowest first. `foundation`: what every verb shares (errors, input checks, JSON lines, atomic writes, cache
# folders, package versions, placement, loading a target). `catalogue`: the divergence rules and where each lives.
# `impl`: our drafter, trainer and evaluator. `drafter_files`: our drafter on disk (ckpt.pt read as a spec, a recipe
# and a body; z-lab's folder format), which everything above reads and writes drafters through. `dflash_world` (the
# tiny trained target the demo and the tests run on) needs only those. `held` (SpecForge and other codebases held to the references) and `serving_engines` (vLLM and
# SGLang reading a drafter) share reference_adapters' rank.
LAYERS = (("foundation", "catalogue"), ("impl",), ("drafter_files",), ("dflash_world",), ("reference_adapters", "held", "serving_engines"),
          ("conformance",), ("dflash_audit",))
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
# Inside a package, highest first: each group is a sub-package or a module of it (`dflash_audit.<group>`).
SUBLAYERS = {"dflash_audit": (("__main__",), ("cli",), ("commands",), ("demo", "serving_readme", "families_readme", "doctor"),
                              ("data_check",), ("trace",), ("audit",), ("conversion", "offline_tau", "tau", "training", "vllm_states"), ("rounds",), ("target_values",), ("flags",), ("outputs",), ("formats",),
                              ("faults", "progress", "prompts", "ranks"))}
SUBRANK = {package: {name: -rank for rank, names in enumerate(groups) for name in names}
           for package, groups in SUBLAYERS.items()}


@functools.lru_cache(maxsize=None)
def parsed(source: str, filename: str) -> ast.Module:
    """One parse per source text: every test below reads the whole repository."""
    return ast.parse(source, filename)


@functools.lru_cache(maxsize=None)
def imported_packages(source: str, filename: str = "<module>") -> tuple[tuple[int, str], ...]:
    """(line, top-level package) of every absolute import in `source` (once per source text)."""
    found = []
    for node in ast.walk(parsed(source, filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return tuple(found)


@functools.lru_cache(maxsize=None)
def imported_modules(source: str, path: str) -> tuple[tuple[int, str], ...]:
    """(line, dotted name) of every import in `source` (function-level too), relative ones resolved against `path`;
    `from a.b import c` gives `a.b.c`, which is the submodule when c is one (once per source text and path)."""
    parts = path[:-len(".py")].split("/")
    package = parts[:-1]
    found = []
    for node in ast.walk(parsed(source, path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]) if node.level \
                else node.module or ""
            found += [(node.lineno, f"{base.strip('.')}.{alias.name}") for alias in node.names]
    return tuple(found)


def group_of(package: str, dotted: list[str]) -> str | None:
    """The declared group of `package` a module path (its parts after the package) belongs to, else None."""
    return dotted[0] if dotted and dotted[0] in SUBRANK[package] else None


def back_edges(sources: dict[str, str]) -> list[str]:
    """`path:line: pkg imports higher` for each import that points up the layers or sideways, between the top-level
    packages and between the declared groups inside a package (`SUBLAYERS`)."""
    edges = []
    for path, source in sorted(sources.items()):
        own = path.split("/")[0]
        for line, package in imported_packages(source, path):
            if package in RANK and package != own and RANK[package] >= RANK[own]:
                edges.append(f"{path}:{line}: {own} imports {package}")
        if own not in SUBRANK:
            continue
        own_group = group_of(own, path[:-len(".py")].split("/")[1:])
        for line, name in imported_modules(source, path):
            parts = name.split(".")
            group = group_of(own, parts[1:]) if parts[0] == own else None
            edge = f"{path}:{line}: {own}.{own_group} imports {own}.{group}"
            if group and own_group and group != own_group and SUBRANK[own][group] >= SUBRANK[own][own_group] \
                    and edge not in edges:
                edges.append(edge)
    return edges


def repo_sources() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for layer in RANK for p in (REPO / layer).rglob("*.py")}


def module_name(path: str) -> str:
    parts = path[:-len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the modules of `sources` it imports (function-level too); `from pkg import sub` is the submodule."""
    modules = {module_name(path): path for path in sources}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in ast.walk(parsed(sources[path], path)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, `level - 1` packages up
                    base = ".".join(filter(None, [package.rsplit(".", node.level - 1)[0] if node.level > 1
                                                  else package, base]))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def import_circles(sources: dict[str, str]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted: modules that import each other."""
    graph, index, low, stack, on_stack, circles = module_imports(sources), {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                circles.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(circles)


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
    # The serving engines (serving_engines/) hold drafters to vLLM and SGLang: no reference, no audit above them.
    ("serving_engines/verdict.py", "from dflash_audit.formats import load_any\n"),
    ("serving_engines/vllm_engine.py", "import reference_adapters.speculators_adapter\n"),
    ("reference_adapters/zlab_adapter.py", "from serving_engines import resolve\n"),
])
def test_a_deliberate_back_edge_fails_the_check(path, source):
    sources = repo_sources()
    sources[path] = sources.get(path, "") + source
    edges = back_edges(sources)
    assert len(edges) == 1 and edges[0].startswith(path)


@pytest.mark.parametrize("path, source", [
    # the audit never calls up into a verb, at module level or inside a function
    ("dflash_audit/audit/live_check.py", "def f():\n    from dflash_audit.commands.eval import register\n"),
    ("dflash_audit/audit/report_terminal.py", "import dflash_audit.commands.serve_check\n"),
    ("dflash_audit/demo.py", "from dflash_audit.commands import compare\n"),
    ("dflash_audit/formats/zlab.py", "def f():\n    from dflash_audit.audit.sides import load_side\n"),
    ("dflash_audit/formats/layouts/dcp.py", "from dflash_audit import conversion\n"),
    ("dflash_audit/progress.py", "from dflash_audit.outputs import check_outputs\n"),
    ("dflash_audit/tau/grid.py", "from dflash_audit.offline_tau import replay_offline\n"),  # sideways
    ("dflash_audit/audit/static.py", "from ..commands import VERBS\n"),  # relative
])
def test_a_deliberate_back_edge_inside_dflash_audit_fails_the_check(path, source):
    sources = repo_sources()
    sources[path] = sources[path] + source
    edges = back_edges(sources)
    assert len(edges) == 1 and edges[0].startswith(path), edges


VERB_MODULES = {f"dflash_audit.commands.{p.stem}" for p in (REPO / "dflash_audit" / "commands").glob("*.py")
                if p.stem != "__init__"}


def verb_imports(sources: dict[str, str]) -> list[str]:
    """`path:line: imports <verb>` for each import of a verb module from outside the CLI (`cli.py`, `commands/`):
    a verb parses its flags, calls one function and prints, so its runner is what others (tests too) call."""
    return [f"{path}:{line}: imports {name}" for path, source in sorted(sources.items())
            if not path.startswith(("dflash_audit/cli.py", "dflash_audit/commands/"))
            for line, name in imported_modules(source, path)
            if name in VERB_MODULES or name.rpartition(".")[0] in VERB_MODULES]


def all_sources() -> dict[str, str]:
    return {**repo_sources(), **{str(p.relative_to(REPO)): p.read_text() for folder in ("tests", "bench")
                                 for p in (REPO / folder).rglob("*.py")}}


def test_only_the_cli_imports_a_verb():
    assert verb_imports(all_sources()) == []


@pytest.mark.parametrize("path, source", [
    ("tests/helpers.py", "def f():\n    from dflash_audit.commands.compare import register\n"),
    ("bench/tau_methods.py", "import dflash_audit.commands.eval\n"),
    ("dflash_audit/audit/eval.py", "from dflash_audit.commands import train\n"),
])
def test_a_planted_verb_import_is_caught(path, source):
    sources = all_sources()
    sources[path] += source
    assert len(verb_imports(sources)) == 1 and verb_imports(sources)[0].startswith(path)


def test_every_module_of_a_layered_package_has_a_declared_group():
    for package, ranks in SUBRANK.items():
        groups = {Path(p).relative_to(package).parts[0].removesuffix(".py") for p in repo_sources()
                  if p.startswith(package + "/") and not p.endswith(f"{package}/__init__.py")}
        assert groups - set(ranks) == set(), f"place these in SUBLAYERS[{package!r}]"
        assert set(ranks) - groups == set(), "a declared group that no longer exists"


def test_no_module_imports_itself_round_a_circle():
    sources = repo_sources()
    assert import_circles(sources) == []


@pytest.mark.parametrize("path, source, circle", [
    # the two circles there were: the layouts read a weight file through foreign.py, which reads the layouts;
    # the engines built `Served`, whose module picked the engine
    ("dflash_audit/formats/layouts/__init__.py", "def f():\n    from dflash_audit.formats.foreign import load_foreign\n",
     ["dflash_audit.formats.foreign", "dflash_audit.formats.layouts"]),
    ("serving_engines/served.py", "def f():\n    from serving_engines import vllm_engine\n",
     ["serving_engines.served", "serving_engines.vllm_engine"]),
    ("foundation/errors.py", "from foundation import placement\n",
     ["foundation.errors", "foundation.inputs", "foundation.placement"]),
])
def test_a_planted_circle_is_caught(path, source, circle):
    sources = repo_sources()
    sources[path] += source
    assert circle in import_circles(sources)



def finding_classes(sources: dict[str, str]) -> list[str]:
    return sorted(path for path, source in sources.items() for node in ast.walk(parsed(source, path))
                  if isinstance(node, ast.ClassDef) and node.name.endswith("Finding"))


def test_every_producer_makes_the_one_finding():
    """One typed finding (catalogue/findings.py) for the static audit, the recipe, τ, serving and the live check."""
    assert finding_classes(repo_sources()) == ["catalogue/findings.py"]


def test_a_second_finding_class_is_caught():
    sources = repo_sources()
    sources["serving_engines/verdict.py"] += "\n\nclass ServingFinding:\n    pass\n"
    assert finding_classes(sources) == ["catalogue/findings.py", "serving_engines/verdict.py"]
