"""Each project-wide rule is stated in one place; these checks fail when a copy comes back.

Source-scanning checks (a rule is restated in code) parse every module of the repo, and each
is proven to catch a planted copy. Import-based checks (a table or registry) assert that every
user holds the very same object.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch

from tests.test_layering import parsed  # one parse per source text, shared with the layering checks

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("foundation", "catalogue", "impl", "dflash_world", "reference_adapters", "held", "serving_engines", "conformance",
            "dflash_audit", "tests", "bench")


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


# -- 1. JSON lines are cut at "\n" only (foundation/jsonl.py) ----------------------------------------------------
def jsonl_splitlines(source: str, path: str = "<module>") -> list[str]:
    """`path:line` of each JSON parse fed by `str.splitlines()`: directly (`json.loads(t.splitlines()[i])`,
    `json_lines(t.splitlines(), ...)`) or through a loop over split lines (also via a name bound to them)."""
    found = []
    tree = parsed(source, path)
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
    "from foundation.jsonl import json_lines\ndef f(t, p, e):\n    return list(json_lines(t.splitlines(), p, e))\n",
    "import json\ndef f(t):\n    out = []\n    for x in t.splitlines():\n        out.append(json.loads(x))\n    return out\n",
    "import json\ndef f(out):\n    return json.loads(out.strip().splitlines()[-1])\n",
])
def test_a_planted_splitlines_on_json_lines_is_caught(planted):
    assert jsonl_splitlines(planted, "impl/planted.py") != []


# -- 2. the z-lab/speculators layer-id shift (impl/layers.py) ---------------------------------------------
OFFSET_HOME = "impl/layers.py"
OFFSET_SCANNED = ("foundation", "impl", "reference_adapters", "held", "serving_engines", "conformance", "dflash_audit",
                  "dflash_world", "bench")
# Names that hold a layer id (or a list of them): `layer_id`, `target_layer_ids`, `aux_ids`, `source_layer`...
LAYER_ID_NAME = re.compile(r"(^|_)(ids|layer_?ids?|aux(_layer)?_?ids?|source_layer|layer)$")
HIDDEN_STATES_NAME = re.compile(r"^(hs|hidden_states?|all_hidden_states)$")


def _last_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call) and node.args and _last_name(node.func) == "int":  # int(i)
        return _last_name(node.args[0])
    return None


def _layer_loops(tree: ast.AST) -> list[tuple[ast.AST, set[str]]]:
    """Each loop or comprehension over layer ids (`for i in layer_ids`, `enumerate(spec.target_layer_ids)`),
    with the names that hold one id."""
    loops = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            pairs = [(g.target, g.iter) for g in node.generators]
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            pairs = [(node.target, node.iter)]
        else:
            continue
        names = set()
        for target, iterable in pairs:
            if isinstance(iterable, ast.Call) and _last_name(iterable.func) == "enumerate" and \
                    isinstance(target, ast.Tuple) and len(target.elts) == 2:
                target, iterable = target.elts[1], iterable.args[0]
            if any(LAYER_ID_NAME.search(_last_name(n) or "") for n in ast.walk(iterable)):
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        if names:
            loops.append((node, names))
    return loops


def layer_offset_copies(source: str, path: str = "<module>") -> list[str]:
    """`path:line` of each layer id shifted by one by hand: `hs[i + 1]`, `[i + 1 for i in layer_ids]`,
    `layer_id - 1`, `i + 1 == num_target_layers`..."""
    tree = parsed(source, path)

    def is_layer_id(node: ast.AST, loop_names: set[str]) -> bool:
        name = _last_name(node)
        return name is not None and not name.startswith("num_") and (name in loop_names or bool(LAYER_ID_NAME.search(name)))

    def shifted(node: ast.AST, loop_names: set[str] = frozenset()) -> bool:
        return (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub))
                and any(isinstance(side, ast.Constant) and side.value == 1 for side in (node.left, node.right))
                and any(is_layer_id(side, loop_names) for side in (node.left, node.right)))

    found = [f"{path}:{sub.lineno}" for loop, names in _layer_loops(tree) for sub in ast.walk(loop) if shifted(sub, names)]
    for node in ast.walk(tree):
        if shifted(node):
            found.append(f"{path}:{node.lineno}")
        elif isinstance(node, ast.Subscript) and HIDDEN_STATES_NAME.match(_last_name(node.value) or "") and \
                isinstance(node.slice, ast.BinOp) and isinstance(node.slice.op, (ast.Add, ast.Sub)):
            found.append(f"{path}:{node.lineno}")  # hidden_states[i + OFFSET]: an index computed by hand
    return sorted(set(found))


def test_the_layer_id_shift_is_written_only_in_impl_layers():
    sources = {path: source for path, source in repo_sources().items()
               if path.startswith(OFFSET_SCANNED) and path != OFFSET_HOME}
    assert len(sources) > 80
    assert [hit for path, source in sources.items() for hit in layer_offset_copies(source, path)] == []
    # ...and the home module does state it (the scan would otherwise prove nothing).
    assert layer_offset_copies((REPO / OFFSET_HOME).read_text(), OFFSET_HOME) != []


@pytest.mark.parametrize("planted", [
    "def f(hidden_states, layer_ids):\n    return [hidden_states[i + 1] for i in layer_ids]\n",
    "def f(hs, spec):\n    return hs[spec.source_layer + 1]\n",
    "OFFSET = 1\ndef f(hs, i):\n    return hs[i + OFFSET]\n",
    "def native_layer_ids(zlab_ids):\n    return [int(i) + 1 for i in zlab_ids]\n",
    "def f(ids, speculators_ids):\n    return [i - 1 for i in ids] if speculators_ids else ids\n",
    "def f(spec):\n    return [i for i in spec.target_layer_ids if i + 1 == spec.num_target_layers]\n",
    "def f(spec):\n    return [k for k, i in enumerate(spec.target_layer_ids) if i + 1 != spec.num_target_layers]\n",
    "def f(aux_layer_ids):\n    return [j - 1 for j in aux_layer_ids]\n",
    "def f(layer_id):\n    return layer_id + 1\n",
])
def test_a_planted_layer_id_shift_is_caught(planted):
    assert layer_offset_copies(planted, "dflash_audit/planted.py") != []


# -- 3. wrapper prefixes (foundation/param_names.py) ------------------------------------------------------------
PREFIX_HOME = "foundation/param_names.py"


def wrapper_prefix_copies(source: str, path: str = "<module>") -> list[str]:
    """`path:line` of each string constant that names a wrapper prefix (`"module."`, `"_orig_mod."`...), i.e.
    a second table or strip loop; `foundation.param_names.WRAPPER_PREFIXES` is the one table."""
    from foundation.param_names import WRAPPER_PREFIXES

    wrappers = {p for p in WRAPPER_PREFIXES if p != "model."}  # "model." also begins the target's own names
    return sorted({f"{path}:{node.lineno}" for node in ast.walk(parsed(source, path))
                   if isinstance(node, ast.Constant) and node.value in wrappers})


def test_wrapper_prefixes_are_listed_only_in_impl_param_names():
    sources = {path: source for path, source in repo_sources().items()
               if path != PREFIX_HOME and not path.startswith(("tests/", "bench/"))}
    assert [hit for path, source in sources.items() for hit in wrapper_prefix_copies(source, path)] == []
    assert wrapper_prefix_copies((REPO / PREFIX_HOME).read_text(), PREFIX_HOME) != []


@pytest.mark.parametrize("planted", [
    'WRAPPER_PREFIXES = ("module.", "_orig_mod.")\n',
    'def strip(name):\n    return name.removeprefix("_orig_mod.")\n',
    'def strip(name):\n    return name[len("module."):] if name.startswith("module.") else name\n',
])
def test_a_planted_wrapper_prefix_table_is_caught(planted):
    assert wrapper_prefix_copies(planted, "dflash_audit/formats/planted.py") != []


def test_every_reader_strips_with_the_one_loop():
    import dflash_audit.formats.key_map as key_map
    import foundation.ckpt_file
    import foundation.param_names
    import held.specforge
    import impl.body_shapes
    import reference_adapters.speculators_adapter
    import reference_adapters.zlab_adapter

    for module in (foundation.ckpt_file, impl.body_shapes, held.specforge, reference_adapters.speculators_adapter,
                   reference_adapters.zlab_adapter):
        assert module.strip_wrapper_prefixes is foundation.param_names.strip_wrapper_prefixes, module.__name__
    assert key_map.strip_wrapper_prefix is foundation.param_names.strip_wrapper_prefix
    assert key_map.strip_prefixes("module._orig_mod.draft_model.fc.weight") == "fc.weight"


# -- 6. DFlash or DFlash2, and the codebook spelling (impl/families.py, foundation/param_names.py) ---------------
FAMILY_HOMES = ("impl/families.py", "foundation/param_names.py")


def family_rule_copies(source: str, path: str = "<module>") -> list[str]:
    """`path:line` of each family or codebook-spelling decision made by hand: the z-lab class names as
    strings, `speculators_model_type` compared with a family, a `_codebook` suffix test or rename, or a
    `conv_kernel_size is (not) None` family test."""
    found = set()
    for node in ast.walk(parsed(source, path)):
        if isinstance(node, ast.Constant) and node.value in ("DFlashDraftModel", "DFlash2DraftModel"):
            found.add(f"{path}:{node.lineno}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value.endswith(("_codebook", "_codebook.weight")) and not node.value.startswith("candidate_selector."):
            found.add(f"{path}:{node.lineno}")  # a suffix test: full names (key lists) are fine
        elif isinstance(node, ast.Compare):
            constants = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)}
            names = {_last_name(n) for n in ast.walk(node)}
            if ("speculators_model_type" in constants and constants & {"dflash", "dflash2"}) or \
                    ("conv_kernel_size" in names | constants and None in constants and
                     isinstance(node.ops[0], (ast.Is, ast.IsNot))):
                found.add(f"{path}:{node.lineno}")
    return sorted(found)


def test_the_family_and_codebook_spelling_are_decided_in_one_place():
    sources = {path: source for path, source in repo_sources().items()
               if path not in FAMILY_HOMES and not path.startswith(("tests/", "bench/"))}
    assert [hit for path, source in sources.items() for hit in family_rule_copies(source, path)] == []
    assert all(family_rule_copies((REPO / home).read_text(), home) for home in FAMILY_HOMES)


@pytest.mark.parametrize("planted", [
    'def f(config):\n    return "dflash2" if "DFlash2DraftModel" in config["architectures"] else "dflash"\n',
    'def f(config):\n    return config.get("speculators_model_type") == "dflash2"\n',
    'def f(spec):\n    return "dflash2" if spec.conv_kernel_size is not None else "dflash"\n',
    'def f(side):\n    return "dflash2" if side.value("conv_kernel_size") is not None else "dflash"\n',
    'def f(name):\n    return name.removesuffix(".weight") if name.endswith("_codebook.weight") else name\n',
    'def f(sd):\n    return {f"{n}.weight" if n.endswith("_codebook") else n: t for n, t in sd.items()}\n',
])
def test_a_planted_family_decision_is_caught(planted):
    assert family_rule_copies(planted, "reference_adapters/planted.py") != []


def test_every_config_reader_asks_the_one_family_function():
    import dflash_audit.formats.speculators
    import impl.families
    import drafter_files.zlab_format
    import reference_adapters.speculators_adapter
    import reference_adapters.zlab_adapter

    for module in (drafter_files.zlab_format, dflash_audit.formats.speculators, reference_adapters.speculators_adapter,
                   reference_adapters.zlab_adapter):
        assert module.config_family is impl.families.config_family, module.__name__
    assert drafter_files.zlab_format.ZLAB_ARCHITECTURES is impl.families.ZLAB_ARCHITECTURES


# -- 7. defaults (impl/defaults.py) ----------------------------------------------------------------------
def test_defaults_are_one_table_each_imported_by_every_reader():
    import dflash_audit.conversion
    import dflash_audit.formats.shape_inference
    import dflash_audit.formats.speculators
    import drafter_files.zlab_format
    import impl.defaults
    import impl.rotary_config
    import impl.spec
    import impl.train

    for module in (drafter_files.zlab_format, impl.rotary_config, impl.spec, dflash_audit.formats.shape_inference):
        assert module.QWEN3_DEFAULTS is impl.defaults.QWEN3_DEFAULTS, module.__name__
        assert module.ROTARY_DEFAULTS is impl.defaults.ROTARY_DEFAULTS, module.__name__
    assert impl.train.rotary_settings is impl.rotary_config.rotary_settings  # the trainer reads a target's rope so too
    for module in (drafter_files.zlab_format, impl.spec, dflash_audit.conversion, dflash_audit.formats.shape_inference):
        assert module.ZLAB_EXTRAS is impl.defaults.ZLAB_EXTRAS, module.__name__
    for module in (drafter_files.zlab_format, impl.spec, dflash_audit.formats.speculators):
        assert module.BLOCK_SIZE_DEFAULTS is impl.defaults.BLOCK_SIZE_DEFAULTS, module.__name__
    spec_defaults = {name: info.default for name, info in impl.spec.SETTINGS.items()}
    for name, value in {**impl.defaults.QWEN3_DEFAULTS, **impl.defaults.ROTARY_DEFAULTS,
                        **impl.defaults.ZLAB_EXTRAS}.items():
        assert spec_defaults[name] == value, name
    assert spec_defaults["block_size"] == impl.defaults.BLOCK_SIZE_DEFAULTS["zlab"]


def default_copies(source: str, path: str = "<module>") -> list[str]:
    """`path:line` of each literal Qwen3 default that only a restated table would hold (rope theta 10000.0,
    32768 positions)."""
    return sorted({f"{path}:{node.lineno}" for node in ast.walk(parsed(source, path))
                   if isinstance(node, ast.Constant) and ((type(node.value) is float and node.value == 10_000.0)
                                                          or (type(node.value) is int and node.value == 32768))})


def test_qwen3_defaults_are_written_only_in_impl_defaults():
    sources = {path: source for path, source in repo_sources().items()
               if path != "impl/defaults.py" and not path.startswith(("tests/", "bench/"))}
    assert [hit for path, source in sources.items() for hit in default_copies(source, path)] == []
    assert default_copies('rope = config.get("rope_theta", 10_000.0)\n') != []
    assert default_copies('window = config.get("max_position_embeddings", 32768)\n') != []


# -- 5. the checkpoint split by concern; report writers start light -----------------------------------
def test_report_writers_do_not_pull_in_qwen3_modeling_at_start_up():
    import subprocess
    import sys

    probe = ("import sys, dflash_audit.audit.report_json, dflash_audit.audit.report_html, dflash_audit.formats; "
             "print('transformers.models.qwen3.modeling_qwen3' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True)
    assert run.stdout.strip() == "False"


def test_atomic_writers_are_imported_from_impl_atomic_only():
    """No module re-exports the atomic writers: each writer imports them from where they live."""
    hits = []
    for path, source in repo_sources().items():
        for node in ast.walk(parsed(source, path)):
            if isinstance(node, ast.ImportFrom) and node.module not in ("foundation.atomic", None) and \
                    {a.name for a in node.names} & {"atomic_write_bytes", "atomic_directory"}:
                hits.append(f"{path}:{node.lineno}")
    assert hits == []


# -- 4. knob validation: once, in the recipe type, in speculators' names ---------------------------------
OLD_KNOB_NAMES = ("loss weighting", "dpace alpha", "target source layer", "loss must be")


def knob_rule_copies(source: str, path: str = "<module>") -> list[str]:
    """`path:line` of each function that decides "D-PACE needs CE" itself (it compares a setting with both
    "dpace" and "ce"), and of each message in the old knob vocabulary."""
    found = set()
    for node in ast.walk(parsed(source, path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            compared = {c.value for cmp in ast.walk(node) if isinstance(cmp, ast.Compare)
                        for c in ast.walk(cmp) if isinstance(c, ast.Constant)}
            if {"dpace", "ce"} <= compared:
                found.add(f"{path}:{node.lineno}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                any(old in node.value.lower() for old in OLD_KNOB_NAMES):
            found.add(f"{path}:{node.lineno}")
    return sorted(found)


def test_knobs_are_validated_only_by_the_recipe_type():
    sources = {path: source for path, source in repo_sources().items()
               if path != "impl/recipe.py" and not path.startswith(("tests/", "bench/"))}
    assert [hit for path, source in sources.items() for hit in knob_rule_copies(source, path)] == []
    assert knob_rule_copies((REPO / "impl/recipe.py").read_text(), "impl/recipe.py") != []


@pytest.mark.parametrize("planted", [
    'def check(cfg):\n    if cfg.per_position_loss_weight == "dpace" and cfg.loss_fn != "ce":\n        raise E("x")\n',
    'def check(cfg):\n    raise E(f"D-PACE loss weighting needs the ce loss, got {cfg.loss_fn!r}")\n',
    'def check(cfg):\n    raise E(f"dpace alpha must be in (0, 1], got {cfg.dpace_alpha}")\n',
])
def test_a_planted_knob_rule_is_caught(planted):
    assert knob_rule_copies(planted, "dflash_audit/commands/planted.py") != []


def test_the_loss_functions_speak_the_recipe_vocabulary():
    import inspect

    import impl.losses

    for function in (impl.losses.dflash_loss, impl.losses.selector_loss, impl.losses.slot_weights,
                     impl.losses.elementwise_loss, impl.losses.dpace_weights):
        names = set(inspect.signature(function).parameters)
        assert not names & {"kind", "weighting", "alpha"}, function.__name__
    assert {"loss_fn", "per_position_loss_weight", "dpace_alpha"} <= set(
        inspect.signature(impl.losses.dflash_loss).parameters)


# -- 8. the field -> catalogue-entry maps live in the catalogue; one RECIPE_FIELDS ------------------------
def test_entry_maps_and_recipe_fields_are_one_table_each():
    import dflash_audit.audit.static_recipe as static_recipe
    import dflash_audit.audit.static_spec as static_spec
    import dflash_audit.formats.shape_inference as inference
    import dflash_audit.formats.setting_names as vocabulary
    import catalogue.pitfalls as pitfalls
    import impl.recipe as spec

    assert static_spec.ARCHITECTURE_ENTRIES is pitfalls.ARCHITECTURE_ENTRIES
    assert static_spec.ARCHITECTURE_WARNINGS is pitfalls.ARCHITECTURE_WARNINGS
    assert static_spec.FAMILY_SPEC_ENTRIES is pitfalls.FAMILY_SPEC_ENTRIES
    assert static_recipe.RECIPE_ENTRIES is pitfalls.RECIPE_ENTRIES
    assert inference.RECIPE_FIELDS is spec.RECIPE_FIELDS
    assert set(pitfalls.RECIPE_ENTRIES) == set(spec.RECIPE_FIELDS) == set(vocabulary.RECIPE_NAMES)
    numbers = [n for n in pitfalls.ARCHITECTURE_ENTRIES.values() if n is not None]
    numbers += [n for n, _, _ in pitfalls.RECIPE_ENTRIES.values()] + [n for entries in pitfalls.FAMILY_SPEC_ENTRIES.values() for _, n, _ in entries.values()]
    assert all(n in pitfalls.PITFALLS for n in numbers)


def test_no_audit_module_keeps_its_own_entry_map():
    """A module-level dict in dflash_audit/ whose values name catalogue entries (`pitfall` numbers) is a second map."""
    hits = []
    for path, source in repo_sources().items():
        if not path.startswith("dflash_audit/"):
            continue
        for node in parsed(source, path).body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id.endswith(("_FIELDS", "_ENTRIES"))
                                                    for t in node.targets) and isinstance(node.value, ast.Dict):
                values = node.value.values
                if values and all(isinstance(v, ast.Tuple) and any(isinstance(e, ast.Constant) and type(e.value) is int
                                                                   for e in v.elts) or
                                  (isinstance(v, ast.Constant) and (v.value is None or type(v.value) is int))
                                  for v in values):
                    hits.append(f"{path}:{node.lineno}")
    assert hits == []


# -- 9. the families and the longest round, each written once ----------------------------------
NON_TEST_SOURCES = ("tests/", "bench/", "conformance/test_")


def family_copies(source: str, path: str = "<module>") -> list[str]:
    """`path:line` of each literal ("dflash", "dflash2") table: the families are impl/families.py's FAMILIES."""
    return sorted({f"{path}:{node.lineno}" for node in ast.walk(parsed(source, path))
                   if isinstance(node, (ast.Tuple, ast.List, ast.Set))
                   and [getattr(e, "value", None) for e in node.elts] == ["dflash", "dflash2"]})


def test_the_families_are_written_only_in_impl_families():
    sources = {path: source for path, source in repo_sources().items()
               if path != "impl/families.py" and not path.startswith(NON_TEST_SOURCES)}
    assert [hit for path, source in sources.items() for hit in family_copies(source, path)] == []
    assert family_copies('FAMILIES = ("dflash", "dflash2")\n') != []
    assert family_copies((REPO / "impl/families.py").read_text(), "impl/families.py") != []


def longest_round_copies(source: str, path: str = "<module>") -> list[str]:
    """`path:line` of each `<...>.speculative_tokens + 1` (or `speculative_tokens(...) + 1`): the longest round is
    impl/slot_layout.py's `longest_round`."""
    def is_speculative_tokens(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "speculative_tokens") or \
            (isinstance(node, ast.Call) and is_speculative_tokens(node.func)) or \
            (isinstance(node, ast.Name) and node.id == "speculative_tokens")
    return sorted({f"{path}:{node.lineno}" for node in ast.walk(parsed(source, path))
                   if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add)
                   and is_speculative_tokens(node.left) and isinstance(node.right, ast.Constant)})


def test_the_longest_round_has_one_home():
    sources = {path: source for path, source in repo_sources().items()
               if path != "impl/slot_layout.py" and not path.startswith(NON_TEST_SOURCES)}
    assert [hit for path, source in sources.items() for hit in longest_round_copies(source, path)] == []
    assert longest_round_copies("longest = drafter.spec.speculative_tokens + 1\n") != []
    assert longest_round_copies("n = speculative_tokens(block, layout) + 1\n") != []


def stop_id_copies(source: str, path: str = "<module>") -> list[str]:
    """`path:line` of each list built around a tokenizer's `eos_token_id`: the stop ids are
    foundation/target_vocab.py's `stop_token_ids`."""
    return sorted({f"{path}:{node.lineno}" for node in ast.walk(parsed(source, path))
                   if isinstance(node, ast.List) and any(isinstance(e, ast.Attribute) and e.attr == "eos_token_id"
                                                         for e in node.elts)})


def test_the_stop_ids_have_one_home():
    sources = {path: source for path, source in repo_sources().items()
               if path != "foundation/target_vocab.py" and not path.startswith(NON_TEST_SOURCES)}
    assert [hit for path, source in sources.items() for hit in stop_id_copies(source, path)] == []
    assert stop_id_copies("stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []\n") != []


def layer_rule_copies(source: str, path: str = "<module>") -> list[str]:
    """`path:line` of each "final layer is N - 1" (a layer count minus one) and each "decoder layers 0..N-1" message:
    impl/layers.py's `final_layer`, `layer_range` and `layers_outside` are their one home."""
    counts = ("num_layers", "num_target_layers", "depth")  # a target's; num_hidden_layers is the drafter's too
    hits = set()
    for node in ast.walk(parsed(source, path)):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and isinstance(node.right, ast.Constant) \
                and node.right.value == 1:
            left = node.left
            name = left.attr if isinstance(left, ast.Attribute) else left.id if isinstance(left, ast.Name) else None
            is_len_of_layers = isinstance(left, ast.Call) and getattr(left.func, "id", None) == "len" and \
                any(isinstance(a, ast.Name) and a.id == "layers" for a in left.args)
            if name in counts or is_len_of_layers:
                hits.add(f"{path}:{node.lineno}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "decoder layers 0.." in node.value:
            hits.add(f"{path}:{node.lineno}")
    return sorted(hits)


def test_the_final_layer_and_the_layer_range_have_one_home():
    sources = {path: source for path, source in repo_sources().items()
               if path != "impl/layers.py" and not path.startswith(NON_TEST_SOURCES)}
    assert [hit for path, source in sources.items() for hit in layer_rule_copies(source, path)] == []


@pytest.mark.parametrize("planted", [
    "def source(cfg, num_layers):\n    return num_layers - 1 if cfg.layer is None else cfg.layer\n",
    "def last(layers):\n    return len(layers) - 1\n",
    'def check(bad, n):\n    raise ValueError(f"{bad} outside the target\'s decoder layers 0..{n}")\n',
])
def test_a_planted_layer_rule_is_caught(planted):
    assert layer_rule_copies(planted, "impl/planted.py") != []


# -- 10. the id range 0..N-1 (foundation/token_ids.py, impl/layers.py) -------------------------------------------
RANGE_HOMES = ("foundation/token_ids.py", "impl/layers.py")


def _minus_one(node: ast.AST) -> bool:
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and isinstance(node.right, ast.Constant) \
        and node.right.value == 1


def id_range_copies(source: str, path: str = "<module>") -> list[str]:
    """`path:line` of each "an id is one of 0..N-1" written by hand: `0 <= i < n` (or `0 <= i <= n - 1`) and the
    tensor form `(ids < 0) | (ids >= n)`. Token ids are foundation/token_ids.py's, layer ids impl/layers.py's."""
    hits = set()
    for node in ast.walk(parsed(source, path)):
        if isinstance(node, ast.Compare) and len(node.ops) == 2 and isinstance(node.left, ast.Constant) \
                and node.left.value == 0 and isinstance(node.ops[0], ast.LtE) and (
                    isinstance(node.ops[1], ast.Lt) or (isinstance(node.ops[1], ast.LtE) and _minus_one(node.comparators[1]))):
            hits.add(f"{path}:{node.lineno}")  # 0..N-1; an inclusive 0..longest (a round, a temperature) is no id
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            ops = {type(side.ops[0]) for side in (node.left, node.right)
                   if isinstance(side, ast.Compare) and len(side.ops) == 1}
            below_zero = any(isinstance(side, ast.Compare) and isinstance(side.ops[0], ast.Lt)
                             and isinstance(side.comparators[0], ast.Constant) and side.comparators[0].value == 0
                             for side in (node.left, node.right))
            if below_zero and ops & {ast.GtE, ast.Gt}:
                hits.add(f"{path}:{node.lineno}")
    return sorted(hits)


def test_the_id_range_has_one_home():
    sources = {path: source for path, source in repo_sources().items()
               if path not in RANGE_HOMES and not path.startswith(NON_TEST_SOURCES)}
    assert [hit for path, source in sources.items() for hit in id_range_copies(source, path)] == []
    assert all(id_range_copies((REPO / home).read_text(), home) for home in RANGE_HOMES)


@pytest.mark.parametrize("planted", [
    "def check(ids, vocab_size):\n    return [i for i in ids if not 0 <= i < vocab_size]\n",
    "def check(spec):\n    assert 0 <= spec.mask_token_id < spec.target_vocab_size\n",
    "def outside(ids, n):\n    return int(((ids < 0) | (ids >= n)).sum())\n",
    "def bad(layer_ids, num_target_layers):\n    return [i for i in layer_ids if not 0 <= i <= num_target_layers - 1]\n",
])
def test_a_planted_id_range_is_caught(planted):
    assert id_range_copies(planted, "impl/planted.py") != []


# -- 11. the [anchor, mask...] block (impl/anchors.py) --------------------------------------------------------------
BLOCK_HOME = "impl/anchors.py"
# The reference adapters build the block the way the reference package they wrap does, never through ours.
BLOCK_EXEMPT = ("reference_adapters/",)


def mask_block_copies(source: str, path: str = "<module>") -> list[str]:
    """`path:line` of each block of mask tokens built by hand: `torch.full(..., mask_token_id, ...)` (also
    `new_full`, `full_like`) or `[mask_token_id] * n`; impl/anchors.py's `anchor_blocks` builds it."""
    def names_mask(node: ast.AST) -> bool:
        return any(_last_name(n) in ("mask_token_id", "mask_id") for n in ast.walk(node))

    hits = set()
    for node in ast.walk(parsed(source, path)):
        if isinstance(node, ast.Call) and _last_name(node.func) in ("full", "new_full", "full_like") and \
                any(names_mask(arg) for arg in [*node.args, *(k.value for k in node.keywords)]):
            hits.add(f"{path}:{node.lineno}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and \
                any(isinstance(side, ast.List) and names_mask(side) for side in (node.left, node.right)):
            hits.add(f"{path}:{node.lineno}")
    return sorted(hits)


def test_the_mask_block_has_one_home():
    sources = {path: source for path, source in repo_sources().items()
               if path != BLOCK_HOME and not path.startswith((*NON_TEST_SOURCES, *BLOCK_EXEMPT))}
    assert [hit for path, source in sources.items() for hit in mask_block_copies(source, path)] == []
    assert mask_block_copies((REPO / BLOCK_HOME).read_text(), BLOCK_HOME) != []


@pytest.mark.parametrize("planted", [
    "def block(drafter, last, size):\n    b = torch.full((1, size), drafter.mask_token_id, dtype=torch.long)\n"
    "    b[0, 0] = last\n    return b\n",
    "def block(spec, last):\n    return [last] + [spec.mask_token_id] * (spec.block_size - 1)\n",
    "def block(ids, mask_token_id, size):\n    return ids.new_full((size,), mask_token_id)\n",
])
def test_a_planted_mask_block_is_caught(planted):
    assert mask_block_copies(planted, "impl/planted.py") != []


def test_the_reference_adapters_build_their_own_blocks():
    """Exempt from the scan above because they do build it, each as its reference package does."""
    import impl.anchors

    for path in ("reference_adapters/speculators_adapter.py", "reference_adapters/speculators_family_decode.py"):
        source = (REPO / path).read_text()
        assert mask_block_copies(source, path) != [] and "anchor_blocks" not in source
    assert impl.anchors.anchor_blocks(torch.tensor([5, 7]), 3, 1).tolist() == [[5, 1, 1], [7, 1, 1]]


# -- 12. does a drafter fit the target (impl/spec.py `spec_misfit`) ---------------------------------------------
# The check is one function of the spec module: the rest of impl/spec.py is scanned like any other source.
FIT_HOME, FIT_FUNCTION = "impl/spec.py", "spec_misfit"
FIT_QUANTITIES = {"hidden_size": "hidden", "vocab_size": "vocabulary", "target_vocab_size": "vocabulary",
                  "num_target_layers": "depth", "num_hidden_layers": "depth", "depth": "depth"}


def fit_check_copies(source: str, path: str = "<module>") -> list[str]:
    """`path:line` of each drafter's hidden size, target depth or vocabulary compared with a target's by hand
    (`spec.hidden_size != config.hidden_size`, `config.get("num_hidden_layers") != spec.num_target_layers`,
    `spec.num_target_layers != len(decoder_layers(target))`): impl/spec.py's `spec_misfit` is the check."""
    def quantity(node: ast.AST) -> str | None:
        if isinstance(node, ast.Call) and _last_name(node.func) == "get" and node.args and \
                isinstance(node.args[0], ast.Constant):
            return FIT_QUANTITIES.get(node.args[0].value)
        if isinstance(node, ast.Call) and _last_name(node.func) == "len" and node.args and \
                "layers" in (_last_name(node.args[0]) or getattr(node.args[0].func, "id", "") if
                             isinstance(node.args[0], ast.Call) else _last_name(node.args[0]) or ""):
            return "depth"
        return FIT_QUANTITIES.get(_last_name(node) or "")

    return sorted({f"{path}:{node.lineno}" for node in ast.walk(parsed(source, path))
                   if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq))
                   and quantity(node.left) is not None and quantity(node.left) == quantity(node.comparators[0])})


def fit_function_lines() -> range:
    """The lines of `spec_misfit` in impl/spec.py: the one place the fit is compared."""
    tree = ast.parse((REPO / FIT_HOME).read_text(), FIT_HOME)
    (function,) = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == FIT_FUNCTION]
    return range(function.lineno, function.end_lineno + 1)


def test_the_drafter_fits_check_has_one_home():
    sources = {path: source for path, source in repo_sources().items() if not path.startswith(NON_TEST_SOURCES)}
    home = [f"{FIT_HOME}:{line}" for line in fit_function_lines()]
    hits = [hit for path, source in sources.items() for hit in fit_check_copies(source, path)]
    assert [hit for hit in hits if hit not in home] == []
    assert [hit for hit in hits if hit in home] != []


@pytest.mark.parametrize("planted", [
    "def fits(spec, config):\n    return spec.hidden_size == config.hidden_size\n",
    "def fits(spec, config):\n    if spec.target_vocab_size != config.vocab_size:\n        raise ValueError('vocabulary')\n",
    "def fits(spec, config):\n    return config.get('num_hidden_layers') != spec.num_target_layers\n",
    "def fits(spec, target):\n    return spec.num_target_layers == len(decoder_layers(target))\n",
    "def fits(spec, config):\n    return spec.num_target_layers != config.num_hidden_layers\n",
    "def fits(spec, config):\n    return spec.target_vocab_size == config.vocab_size\n",
])
def test_a_planted_drafter_fits_check_is_caught(planted):
    assert fit_check_copies(planted, "dflash_audit/commands/planted.py") != []


def test_eval_and_compare_ask_the_one_fit_check_and_run_the_one_offline_runner():
    import dflash_audit.audit.drafter_fit as drafter_fit
    import dflash_audit.audit.dynamic as dynamic
    import dflash_audit.audit.eval as eval_command
    import dflash_audit.formats.speculators as speculators
    import dflash_audit.offline_tau as offline_tau
    import impl.spec

    assert dynamic.misfit is drafter_fit.misfit  # and eval reads its drafter through drafter_fit's misfit:
    # (read_loaded_drafter: read_drafter's one check, the drafter as loaded returned with its recipe)
    assert "from dflash_audit.audit.drafter_fit import place_drafter, read_loaded_drafter" in \
        inspect.getsource(eval_command)
    assert "read_loaded_drafter(path, target_dir, config, options)" in inspect.getsource(drafter_fit.read_drafter)
    assert drafter_fit.spec_misfit is speculators.spec_misfit is impl.spec.spec_misfit
    assert dynamic.replay_offline is offline_tau.replay_offline
    # eval imports the runner when it runs (its bad-input refusals come before any modelling import)
    assert "from dflash_audit.offline_tau import replay_offline" in inspect.getsource(eval_command)
    for module in (eval_command, dynamic):  # neither replays on its own
        assert not hasattr(module, "offline_rounds_each") and not hasattr(module, "load_or_build_cache")


# -- 13. the block size's defaults as parameter defaults (impl/defaults.py) ---------------------------------------
def block_default_copies(source: str, path: str = "<module>") -> list[str]:
    """`path:line` of each `block_size` parameter defaulting to one of the formats' default block sizes (z-lab's 16,
    speculators' 8): impl/defaults.py's BLOCK_SIZE_DEFAULTS holds them."""
    from impl.defaults import BLOCK_SIZE_DEFAULTS

    hits = set()
    for node in ast.walk(parsed(source, path)):
        if isinstance(node, ast.arguments):
            positional = node.posonlyargs + node.args
            pairs = list(zip([a.arg for a in positional[len(positional) - len(node.defaults):]], node.defaults))
            pairs += [(a.arg, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
            hits |= {f"{path}:{value.lineno}" for name, value in pairs if name == "block_size"
                     and isinstance(value, ast.Constant) and value.value in BLOCK_SIZE_DEFAULTS.values()}
    return sorted(hits)


def test_no_function_restates_a_default_block_size():
    sources = {path: source for path, source in repo_sources().items() if not path.startswith(NON_TEST_SOURCES)}
    assert [hit for path, source in sources.items() for hit in block_default_copies(source, path)] == []


@pytest.mark.parametrize("planted", [
    "def draft(drafter, block_size=16):\n    pass\n",
    "def convert(spec, *, block_size: int = 8):\n    pass\n",
])
def test_a_planted_default_block_size_is_caught(planted):
    assert block_default_copies(planted, "impl/planted.py") != []


# -- 13. a drafter setting's bounds: its declaration's, checked by pydantic (impl/spec.py) ----------------------------
# (A setting's or a knob's default is never restated: every user derives it from the declaration, the run settings'
# fields included, which tests/test_recipe_knobs.py holds to it.)
SPEC_HOMES = ("impl/spec.py", "impl/settings.py")


def spec_bound_copies(source: str, path: str = "<module>") -> list[str]:
    """`path:line` of a spec's or a run's setting compared by hand with one of its declared bounds
    (`cfg.block_size <= 0`, `spec.partial_rotary_factor <= 1`, `spec.hidden_size > MAX_DIMENSION`). A function's
    guard of its own argument (`block_size <= 0` in select_anchors) is its own contract, not the setting's."""
    from impl import settings, spec

    bounded = {name: set(found.values()) for name in spec.SETTINGS
               if (found := settings.declared_range(spec.DraftSpec, name))}
    bounded.update({spec.RUN_FIELDS[n]: bounded[n] for n in spec.TRAIN_SETTINGS if n in bounded})
    hits = set()
    for node in ast.walk(parsed(source, path)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for a, op, b in zip(operands, node.ops, operands[1:]):
            if not isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)):
                continue
            for setting, bound in ((a, b), (b, a)):
                if isinstance(setting, ast.Attribute) and setting.attr in bounded and (
                        (isinstance(bound, ast.Constant) and type(bound.value) in (int, float)
                         and bound.value in bounded[setting.attr])
                        or _last_name(bound) in ("MAX_DIMENSION", "MAX_POSITIONS")):
                    hits.add(f"{path}:{node.lineno}")
    return sorted(hits)


def test_a_spec_setting_bound_is_checked_only_by_its_declaration():
    sources = {path: source for path, source in repo_sources().items()
               if path not in SPEC_HOMES and not path.startswith(NON_TEST_SOURCES)}
    assert [hit for path, source in sources.items() for hit in spec_bound_copies(source, path)] == []


@pytest.mark.parametrize("planted", [
    "def check(cfg):\n    if cfg.block_size <= 0:\n        raise ValueError('block_size')\n",
    "def check(spec):\n    assert 0 < spec.partial_rotary_factor <= 1\n",
    "def check(spec):\n    return spec.hidden_size > MAX_DIMENSION\n",
    "def check(cfg):\n    return cfg.draft_vocab_size is not None and cfg.draft_vocab_size <= 0\n",
])
def test_a_planted_spec_bound_is_caught(planted):
    assert spec_bound_copies(planted, "dflash_audit/commands/planted.py") != []
