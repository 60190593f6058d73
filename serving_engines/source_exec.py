"""Run an engine's own function from its installed source file when its module cannot be imported on a CPU
machine (its imports pull in GPU kernels): the function's definition is compiled from the file's AST, under the
file's own path and line numbers, with the few module-level names it reads supplied by the caller.

Nothing is copied: the bytes executed are the installed file's, and `sha256` says which file that was.
"""

from __future__ import annotations
import __future__

import ast
import hashlib
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class SourceError(RuntimeError):
    """An engine file or definition is not where the installed package should have it."""


def installed_file(module: str) -> Path:
    """The installed source file of `module`, found without importing it (nor its parent packages)."""
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"{top} is not installed (make setup installs it)")
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*rest.split(".")).with_suffix(".py")
    if not path.is_file():
        raise SourceError(f"{path}: not in the installed {top}")
    return path


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def line_of(module: str, needle: str) -> int:
    """The 1-based line of the first occurrence of `needle` in the installed file (for file:line citations)."""
    for number, line in enumerate(installed_file(module).read_text(encoding="utf-8").splitlines(), 1):
        if needle in line:
            return number
    raise SourceError(f"{module}: {needle!r} not found in the installed file")


def cite(module: str, needle: str) -> str:
    """`pkg/path/file.py:LINE`, relative to site-packages."""
    path = installed_file(module)
    root = module.split(".")[0]
    relative = path.as_posix().split(f"/{root}/", 1)[-1]
    return f"{root}/{relative}:{line_of(module, needle)}"


@dataclass
class SourceDefinitions:
    """Definitions compiled from one installed file; `namespace[name]` is callable like the original."""

    module: str
    path: Path
    sha256: str
    namespace: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.namespace[name]


def _defined_names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _stdlib_imports(tree: ast.Module) -> list[ast.stmt]:
    """The file's own top-level imports of the standard library (typing, dataclasses, numbers, ...)."""
    keep = []
    for node in tree.body:
        if isinstance(node, ast.Import) and all(a.name.split(".")[0] in sys.stdlib_module_names for a in node.names):
            keep.append(node)
        elif (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
              and node.module.split(".")[0] in sys.stdlib_module_names and node.module != "__future__"):
            keep.append(node)
    return keep


def _method(tree: ast.Module, qualified: str) -> ast.FunctionDef:
    class_name, method_name = qualified.split(".", 1)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method_name:
                    return item
    raise SourceError(f"{qualified} not found")


def compile_definitions(module: str, names: list[str], supplied: dict[str, Any] | None = None) -> SourceDefinitions:
    """Compile the top-level definitions `names` (functions, classes, constants; `Class.method` for one
    method, bound under the method's name) of the installed `module`, in file order, in a namespace holding
    the file's standard-library imports and `supplied` (the module-level names the definitions read)."""
    path = installed_file(module)
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source, str(path))
    # A module object of its own (dataclasses look their class's module up in sys.modules).
    holder = types.ModuleType(f"serving_engines.source.{module}")
    holder.__file__ = str(path)
    sys.modules[holder.__name__] = holder
    namespace = holder.__dict__
    for node in _stdlib_imports(tree):
        exec(compile(ast.Module([node], []), str(path), "exec", dont_inherit=True), namespace)  # noqa: S102
    namespace.update(supplied or {})
    wanted = set(names)
    plain = [n for n in wanted if "." not in n]
    selected = [node for node in tree.body if set(_defined_names(node)) & set(plain)]
    found = {name for node in selected for name in _defined_names(node)}
    missing = sorted(set(plain) - found)
    if missing:
        raise SourceError(f"{path}: no top-level definition of {missing}")
    selected += [_method(tree, n) for n in sorted(wanted - set(plain))]
    selected.sort(key=lambda node: node.lineno)
    # The installed file's path as the code's filename: tracebacks and co_firstlineno point into it.
    flags = sum(getattr(__future__, a.name).compiler_flag for node in tree.body
                if isinstance(node, ast.ImportFrom) and node.module == "__future__" for a in node.names)
    code = compile(ast.Module(selected, []), str(path), "exec", flags=flags, dont_inherit=True)
    exec(code, namespace)  # noqa: S102 -- the engine's own code
    return SourceDefinitions(module, path, file_sha256(path), namespace)
