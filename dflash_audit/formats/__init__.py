"""Which format a drafter path is in, and loading any of them into one normalized checkpoint.

- ours: a `*.pt` file our trainer wrote (`impl.checkpoint`, `torch.load(weights_only=True)`);
- speculators: a directory whose config.json has `speculators_model_type: dflash`;
- zlab: a directory whose config.json has `dflash_config` or architecture `DFlashDraftModel`;
- foreign: any other checkpoint (`foreign.py`): `*.pt`, `*.pth`, `*.bin`, `*.ckpt`,
  `*.safetensors`, or a folder of them, with its own names, entries and training args.

Every loader returns a `LoadedCheckpoint`: an `impl.checkpoint.Checkpoint` (normalized
`DraftSpec`, z-lab layer ids, draft-body tensors only) that also keeps what a report
needs to show the raw side: the raw config, the raw layer ids and their convention, the
verifier-owned tensors a speculators directory may carry, and where each spec field came
from (`provenance`). A foreign checkpoint whose spec is incomplete loads with `spec=None`
(what is known sits in `known_spec`); `require_spec` says what is missing and how to give it.
Nothing is ever unpickled beyond plain data (`safe_pickle.py`).
"""

from __future__ import annotations

import dataclasses
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from impl.errors import AuditError
from dflash_audit.formats.foreign import (PICKLE_SUFFIXES, WEIGHT_SUFFIXES, LoadOptions, UnknownScheme,
                                          read_foreign)
from dflash_audit.formats.inference import Provenance, parse_cli_spec
from dflash_audit.formats.vocabulary import DeclarationError
from impl.checkpoint import (CKPT_FORMAT, VERIFIER_OWNED_KEYS, Checkpoint, CheckpointError, load_checkpoint, read_config,
                             read_safetensors_dir, spec_from_zlab_config)
from impl.layers import speculators_to_zlab
from impl.spec import DraftSpec, Recipe, SpecError

FORMATS = ("ours", "zlab", "speculators")  # the formats `convert` writes
READ_FORMATS = FORMATS + ("foreign",)

__all__ = ["FORMATS", "READ_FORMATS", "VERIFIER_OWNED_KEYS", "LoadedCheckpoint", "LoadOptions", "UnknownScheme",
           "detect_format", "load_any", "require_spec"]


@dataclass
class LoadedCheckpoint(Checkpoint):
    path: str = ""
    format: str = ""
    # {"config": raw config.json or None, "layer_ids": ids as written, "layer_id_convention": "zlab" | "speculators",
    #  plus format-specific settings our spec cannot hold (e.g. speculators' sample_from_anchor)}.
    raw: dict[str, Any] = field(default_factory=dict)
    verifier_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    provenance: dict[str, Provenance] = field(default_factory=dict)  # spec field / "recipe.<field>" -> source
    known_spec: dict[str, Any] = field(default_factory=dict)  # every known spec field (all of them when spec is set)
    recipe_unknown: list[str] = field(default_factory=list)  # recipe fields nobody declared
    contradictions: list[str] = field(default_factory=list)  # the checkpoint disagreeing with itself
    foreign: dict[str, Any] = field(default_factory=dict)  # entry used, ignored entries, key map, unrecognized keys


# -- detection ---------------------------------------------------------------------------
def _config_of(path: Path) -> dict[str, Any] | None:
    config_path = path / "config.json"
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AuditError(f"{config_path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AuditError(f"{config_path}: expected a JSON object, found {type(config).__name__}")
    return config


def is_our_checkpoint(path: Path) -> bool:
    """Whether a pickle file carries our trainer's format tag (read from its bytes, nothing unpickled)."""
    marker = CKPT_FORMAT.encode()
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
                return name is not None and marker in archive.read(name)
        with open(path, "rb") as handle:
            return marker in handle.read(1 << 20)
    except (OSError, zipfile.BadZipFile):
        return False


def detect_format(path: str | Path) -> str:
    """`ours`, `zlab`, `speculators` or `foreign`; an AuditError saying what was found otherwise."""
    path = Path(path)
    if not path.exists():
        raise AuditError(f"{path}: no such file or directory")
    if path.is_file():
        if path.name.endswith(PICKLE_SUFFIXES):
            return "ours" if is_our_checkpoint(path) else "foreign"
        if path.name.endswith(WEIGHT_SUFFIXES):
            return "foreign"
        raise AuditError(f"{path}: not a checkpoint file (expected *.pt, *.pth, *.bin, *.ckpt or *.safetensors, "
                         "or a z-lab / speculators directory)")
    if not path.is_dir():
        raise AuditError(f"{path}: neither a file nor a directory")
    config = _config_of(path)
    if config is not None:
        kind = config.get("speculators_model_type")
        if kind == "dflash":
            return "speculators"
        if kind is not None:
            raise AuditError(f"{path}: a speculators {kind!r} model, not a DFlash drafter")
        if "dflash_config" in config or "DFlashDraftModel" in (config.get("architectures") or []):
            return "zlab"
        described = config.get("architectures") or config.get("model_type")
        if any(str(a).endswith(("ForCausalLM", "ForConditionalGeneration")) for a in (config.get("architectures") or [])):
            raise AuditError(f"{path}/config.json describes {described}, a language model, not a DFlash drafter "
                             "(no dflash_config, no speculators_model_type)")
    if any(p.name.endswith(WEIGHT_SUFFIXES) or p.name.endswith(".index.json") for p in path.iterdir()):
        return "foreign"
    found = sorted(p.name for p in path.iterdir())[:5]
    raise AuditError(f"{path}: a directory with no drafter in it: no z-lab or speculators config.json and no weight "
                     f"files (found {found or 'nothing'})")


# -- loading -----------------------------------------------------------------------------
def load_any(path: str | Path, target_dir: str | Path | None = None,
             options: LoadOptions | None = None) -> LoadedCheckpoint:
    """Any drafter, normalized. `target_dir` (the verifier) tells a speculators drafter's verifier depth and a
    foreign drafter's target depth and vocabulary; `options` carry the user's entry, key map and spec fields."""
    options = options or LoadOptions()
    fmt = detect_format(path)
    path = Path(path)
    if fmt == "foreign":
        return load_foreign(path, options, target_dir)
    if options.entry is not None or options.key_map is not None:
        flag = options.flag("entry") if options.entry is not None else "--key-map"
        raise AuditError(f"{path}: a {fmt} drafter has one known layout; {flag} applies to other checkpoints only")
    loaded = {"ours": load_ours, "zlab": load_zlab}[fmt](path) if fmt != "speculators" else \
        load_speculators(path, target_dir)
    return apply_cli_spec(loaded, options)


def require_spec(loaded: LoadedCheckpoint, what: str) -> DraftSpec:
    """The complete spec, or a one-line error naming every missing field and the flag that gives it."""
    if loaded.spec is not None:
        return loaded.spec
    details = {name: p.detail for name, p in loaded.provenance.items()}
    raise incomplete_spec(loaded.path, loaded.known_spec, details, what)


def incomplete_spec(path: str, known: dict[str, Any], details: dict[str, str], what: str) -> AuditError:
    missing = [name for name in (f.name for f in dataclasses.fields(DraftSpec)) if name not in known]
    hints = "; ".join(f"{name}: {details.get(name, 'unknown')}" for name in missing)
    return AuditError(f"{path}: {what} needs the whole spec, and {len(missing)} field(s) are unknown "
                      f"({', '.join(missing)}). {hints}")


def declared_provenance(spec: DraftSpec, detail: str, present: set[str] | None = None,
                        defaulted_detail: str = "not in the config; the format's default") -> dict[str, Provenance]:
    """Every field declared by the file, except those absent from it (`present` given) which took a default."""
    return {f.name: Provenance("declared", detail) if present is None or f.name in present
            else Provenance("default", defaulted_detail) for f in dataclasses.fields(DraftSpec)}


def apply_cli_spec(loaded: LoadedCheckpoint, options: LoadOptions) -> LoadedCheckpoint:
    """`--ours-spec KEY=VALUE` on a drafter of a known format: the value replaces what the file says."""
    if loaded.spec is not None:
        loaded.known_spec = loaded.spec.to_dict()
    if not options.spec:
        return loaded
    try:
        cli = parse_cli_spec(options.spec, options.flag("spec"))
    except DeclarationError as exc:
        raise AuditError(str(exc)) from exc
    spec_fields = {f.name for f in dataclasses.fields(DraftSpec)}
    spec_changes = {k: (tuple(v) if isinstance(v, list) else v) for k, (v, _) in cli.items() if k in spec_fields}
    recipe_changes = {k: v for k, (v, _) in cli.items() if k not in spec_fields}
    try:
        loaded.spec = dataclasses.replace(loaded.spec, **spec_changes)
        if recipe_changes:
            loaded.recipe = dataclasses.replace(loaded.recipe or Recipe(), **recipe_changes)
    except SpecError as exc:
        raise AuditError(f"{loaded.path}: {options.flag('spec')}: {exc}") from exc
    for name, (_, detail) in cli.items():
        loaded.provenance[name if name in spec_fields else f"recipe.{name}"] = Provenance("cli", detail)
    loaded.known_spec = loaded.spec.to_dict()
    return loaded


def load_foreign(path: Path, options: LoadOptions, target_dir: str | Path | None) -> LoadedCheckpoint:
    read = read_foreign(path, options, target_dir)
    inference = read.inference
    try:
        spec = inference.spec(str(path))
        recipe = inference.recipe()
    except (DeclarationError, SpecError) as exc:
        raise CheckpointError(f"{path}: {exc}" if str(path) not in str(exc) else str(exc)) from exc
    body = {k: v for k, v in read.tensors.items() if k not in VERIFIER_OWNED_KEYS}
    owned = {k: v for k, v in read.tensors.items() if k in VERIFIER_OWNED_KEYS}
    known = dict(inference.values)
    if "target_layer_ids" in known:
        known["target_layer_ids"] = list(known["target_layer_ids"])
    foreign = {"files": read.files, "entry": read.payload.entry, "ignored_entries": read.payload.ignored,
               "key_map": {"scheme": read.mapping.scheme, "renamed": read.mapping.renamed,
                           "unmapped": read.mapping.unmapped},
               "unrecognized_keys": inference.unrecognized, "fc_layer_count": inference.fc_layer_count}
    ids = known.get("target_layer_ids")
    return LoadedCheckpoint(spec=spec, state_dict=body, recipe=recipe, path=str(path), format="foreign",
                            raw={"config": None, "layer_ids": ids, "layer_id_convention": "zlab"},
                            verifier_tensors=owned, provenance=inference.provenance, known_spec=known,
                            recipe_unknown=inference.recipe_unknown, contradictions=inference.contradictions,
                            foreign=foreign)


def load_ours(path: Path) -> LoadedCheckpoint:
    ckpt = load_checkpoint(path)
    return LoadedCheckpoint(spec=ckpt.spec, state_dict=ckpt.state_dict, recipe=ckpt.recipe, step=ckpt.step,
                            optimizer=ckpt.optimizer, recipe_unknown=ckpt.recipe_unknown, path=str(path), format="ours",
                            raw={"config": None, "layer_ids": list(ckpt.spec.target_layer_ids),
                                 "layer_id_convention": "zlab"},
                            provenance=declared_provenance(ckpt.spec, f"{path.name}: spec"))


def load_zlab(path: Path) -> LoadedCheckpoint:
    config = read_config(path)
    spec = spec_from_zlab_config(config, source=str(path / "config.json"))
    written = (config.get("dflash_config") or {}).get("target_layer_ids", config.get("target_layer_ids"))
    provenance = declared_provenance(spec, "config.json", config_keys(config))
    if written is None:
        provenance["target_layer_ids"] = Provenance("default", "not in config.json; z-lab's build_target_layer_ids")
    return LoadedCheckpoint(spec=spec, state_dict=read_safetensors_dir(path), path=str(path), format="zlab",
                            raw={"config": config, "layer_ids": written, "layer_id_convention": "zlab",
                                 "layer_ids_defaulted": written is None}, provenance=provenance)


def config_keys(config: dict[str, Any]) -> set[str]:
    """Spec fields a z-lab (or z-lab-shaped) config.json states itself."""
    present = set(config) | set(config.get("dflash_config") or {})
    if "rope_parameters" in config or "rope_scaling" in config:
        present.add("rope_theta")
    if "use_sliding_window" in config:
        present.add("sliding_window")
    return present


def verifier_layer_count(config: dict[str, Any], target_dir: str | Path | None, source: str) -> int:
    """Decoder layers of a speculators drafter's verifier: from `target_dir`, else its recorded local verifier."""
    recorded = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    for candidate in (target_dir, recorded):
        if candidate and (Path(candidate) / "config.json").is_file():
            verifier = json.loads((Path(candidate) / "config.json").read_text())
            verifier = verifier.get("text_config", verifier)  # multimodal verifiers nest it
            if "num_hidden_layers" in verifier:
                return int(verifier["num_hidden_layers"])
    if "num_target_layers" in config:
        return int(config["num_target_layers"])
    raise CheckpointError(f"{source}: cannot tell the verifier's layer count: its verifier {recorded!r} is not a "
                          "local directory; pass the target directory (--target)")


def zlab_shaped_config(config: dict[str, Any], num_target_layers: int, source: str) -> dict[str, Any]:
    """A speculators config.json rewritten as the z-lab config of the same drafter (ids shifted back)."""
    from transformers import AutoConfig

    layer_config = dict(config.get("transformer_layer_config") or {})
    if not layer_config:
        raise CheckpointError(f"{source}: no transformer_layer_config")
    # Fill Qwen3 defaults for the fields its diff-dict left out, as speculators does on load.
    full = AutoConfig.for_model(**{"model_type": "qwen3", **layer_config}).to_dict()
    aux = config.get("aux_hidden_state_layer_ids")
    if not aux:
        raise CheckpointError(f"{source}: no aux_hidden_state_layer_ids")
    try:
        ids = speculators_to_zlab(aux)
    except ValueError as exc:
        raise CheckpointError(f"{source}: aux_hidden_state_layer_ids: {exc}") from exc
    full.update(num_target_layers=num_target_layers, dflash_config={
        "target_layer_ids": ids, "mask_token_id": config.get("mask_token_id"),
        "block_size": config.get("block_size", 8)})  # speculators' default block size
    return full


def load_speculators(path: Path, target_dir: str | Path | None = None) -> LoadedCheckpoint:
    source = str(path / "config.json")
    config = read_config(path)
    num_target_layers = verifier_layer_count(config, target_dir, source)
    spec = spec_from_zlab_config(zlab_shaped_config(config, num_target_layers, source), source=source)
    tensors = read_safetensors_dir(path)
    verifier = {k: tensors.pop(k) for k in VERIFIER_OWNED_KEYS if k in tensors}
    raw = {"config": config, "layer_ids": list(config["aux_hidden_state_layer_ids"]),
           "layer_id_convention": "speculators",
           "sample_from_anchor": bool(config.get("sample_from_anchor", False)),
           "sliding_window_non_causal": bool(config.get("sliding_window_non_causal", False)),
           "draft_vocab_size": config.get("draft_vocab_size", spec.vocab_size),
           "verifier": ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")}
    present = set(config) | set(config.get("transformer_layer_config") or {}) | {"target_layer_ids",
                                                                                  "num_target_layers"}
    provenance = declared_provenance(spec, "config.json", present | {"rope_theta", "sliding_window"},
                                     "not in config.json; Qwen3's default")
    provenance["target_layer_ids"] = Provenance("declared", "config.json aux_hidden_state_layer_ids (id - 1)")
    provenance["num_target_layers"] = Provenance("inferred", "the verifier's config.json num_hidden_layers")
    if "block_size" not in config:
        provenance["block_size"] = Provenance("default", "not in config.json; speculators' default 8")
    return LoadedCheckpoint(spec=spec, state_dict=tensors, path=str(path), format="speculators", raw=raw,
                            verifier_tensors=verifier, provenance=provenance)
