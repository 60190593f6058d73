"""Which format a drafter path is in, and loading any of them into one normalized checkpoint.

One module per format, each with `detect`, `load` and `save`:
- `ours.py`: a `*.pt` file our trainer wrote (`torch.load(weights_only=True)`);
- `zlab.py`: a directory whose config.json has `dflash_config` or architecture `DFlashDraftModel`;
- `speculators.py`: a directory whose config.json has `speculators_model_type: dflash`;
- `gguf_file.py`: a `.gguf` file (llama.cpp's format, detected by its magic), read only here (llama.cpp's own
  converter writes it: `convert --for llamacpp`);
- `foreign.py`: any other checkpoint (`*.pt`, `*.pth`, `*.bin`, `*.ckpt`, `*.safetensors`, or a
  folder of them) with its own names, entries and training args; read only, never written.

Every loader returns a `loaded.LoadedCheckpoint`: an `drafter_files.checkpoint.Checkpoint` (normalized
`DraftSpec`, z-lab layer ids, draft-body tensors only) with its raw on-disk record, the
verifier-owned tensors kept apart, and where each spec field came from (`provenance`). A
foreign checkpoint whose spec is incomplete loads with `spec=None` (what is known sits in
`known_spec`); `require_spec` says what is missing and how to give it. Nothing is ever
unpickled beyond plain data (`safe_pickle.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_audit.formats import gguf_file, layouts, ours, speculators, zlab
from dflash_audit.formats.foreign import WEIGHT_SUFFIXES, UnknownScheme, load_foreign
from dflash_audit.formats.loaded import (
    LoadedCheckpoint,
    LoadOptions,
    RawRecord,
    apply_cli_spec,
    incomplete_spec,
    require_spec,
)
from foundation.errors import AuditError
from foundation.inputs import check_no_special_files, read_json_object
from foundation.param_names import VERIFIER_OWNED_KEYS

FORMATS = ("ours", "zlab", "speculators")  # the formats `convert` writes
MODULES = {"ours": ours, "zlab": zlab, "speculators": speculators}

__all__ = ["FORMATS", "MODULES", "VERIFIER_OWNED_KEYS", "LoadOptions", "LoadedCheckpoint",
           "RawRecord", "UnknownScheme", "detect_format", "incomplete_spec", "load_any", "require_spec"]


# -- detection ---------------------------------------------------------------------------
# The sections of a drafter's config.json that every reader takes for objects.
CONFIG_SECTIONS = ("dflash_config", "speculators_config", "transformer_layer_config", "text_config",
                   "rope_parameters", "rope_scaling")


def _config_of(path: Path) -> dict[str, Any] | None:
    config_path = path / "config.json"
    if not config_path.is_file():
        return None
    config = read_json_object(config_path, "config.json")
    for section in CONFIG_SECTIONS:
        if config.get(section) is not None and not isinstance(config[section], dict):
            raise AuditError(f"{config_path}: field {section!r} must be a JSON object, found "
                             f"{type(config[section]).__name__} {str(config[section])[:60]}")
    return config


def detect_format(path: str | Path) -> str:
    """`ours`, `zlab`, `speculators`, `gguf` or `foreign`; an AuditError saying what was found otherwise."""
    path = Path(path)
    if not path.exists():
        raise AuditError(f"{path}: no such file or directory")
    if path.is_file() and (gguf_file.detect(path) or path.name.endswith(".gguf")):
        return "gguf"  # by its magic; a `.gguf` name without it is read and refused as not GGUF
    if layouts.detect(path) is not None:  # a framework's layout (DCP, DeepSpeed, Megatron, NeMo)
        return "foreign"
    if path.is_file():
        if path.name.endswith(WEIGHT_SUFFIXES):
            return "ours" if ours.detect(path) else "foreign"
        raise AuditError(f"{path}: not a checkpoint file (expected *.pt, *.pth, *.bin, *.ckpt, *.safetensors or "
                         "*.nemo, or a z-lab / speculators / framework checkpoint directory)")
    if not path.is_dir():
        raise AuditError(f"{path}: neither a file nor a directory")
    check_no_special_files(path, "in the drafter directory")
    config = _config_of(path)
    if config is not None:
        if speculators.detect(config):
            return "speculators"
        kind = config.get("speculators_model_type")
        if kind is not None:
            raise AuditError(f"{path}: a speculators {kind!r} model, not a DFlash drafter")
        if zlab.detect(config):
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
    if fmt == "gguf":
        loaded = gguf_file.load(path, target_dir)
    else:
        loaded = speculators.load(path, target_dir) if fmt == "speculators" else MODULES[fmt].load(path)
    return apply_cli_spec(loaded, options)
