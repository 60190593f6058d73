"""Which format a drafter path is in, and loading any of them into one normalized checkpoint.

- ours: a `*.pt` file (`impl.checkpoint`, `torch.load(weights_only=True)`);
- speculators: a directory whose config.json has `speculators_model_type: dflash`;
- zlab: a directory whose config.json has `dflash_config` or architecture `DFlashDraftModel`.

Every loader returns a `LoadedCheckpoint`: an `impl.checkpoint.Checkpoint` (normalized
`DraftSpec`, z-lab layer ids, draft-body tensors only) that also keeps what a report
needs to show the raw side: the raw config, the raw layer ids and their convention, and
the verifier-owned tensors a speculators directory may carry. Weights are streamed from
safetensors; nothing is unpickled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_audit.errors import AuditError
from impl.checkpoint import (Checkpoint, CheckpointError, load_checkpoint, read_config, read_safetensors_dir,
                             spec_from_zlab_config)
from impl.layers import speculators_to_zlab

FORMATS = ("ours", "zlab", "speculators")
# Tensors a speculators directory may hold that belong to the verifier, not the draft body.
VERIFIER_OWNED_KEYS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight",
                       "t2d", "d2t")


@dataclass
class LoadedCheckpoint(Checkpoint):
    path: str = ""
    format: str = ""
    # {"config": raw config.json or None, "layer_ids": ids as written, "layer_id_convention": "zlab" | "speculators",
    #  plus format-specific settings our spec cannot hold (e.g. speculators' sample_from_anchor)}.
    raw: dict[str, Any] = field(default_factory=dict)
    verifier_tensors: dict[str, torch.Tensor] = field(default_factory=dict)


# -- detection ---------------------------------------------------------------------------
def _config_of(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    if not config_path.is_file():
        found = sorted(p.name for p in path.iterdir())[:5]
        raise AuditError(f"{path}: a directory without config.json (found {found or 'nothing'}), "
                         "so neither a z-lab nor a speculators drafter")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AuditError(f"{config_path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AuditError(f"{config_path}: expected a JSON object, found {type(config).__name__}")
    return config


def detect_format(path: str | Path) -> str:
    """`ours`, `zlab` or `speculators`; an AuditError saying what was found otherwise."""
    path = Path(path)
    if not path.exists():
        raise AuditError(f"{path}: no such file or directory")
    if path.is_file():
        if path.suffix == ".pt":
            return "ours"
        raise AuditError(f"{path}: a file that is not a *.pt checkpoint (ours); z-lab and speculators drafters "
                         "are directories with a config.json")
    config = _config_of(path)
    kind = config.get("speculators_model_type")
    if kind == "dflash":
        return "speculators"
    if kind is not None:
        raise AuditError(f"{path}: a speculators {kind!r} model, not a DFlash drafter")
    if "dflash_config" in config or "DFlashDraftModel" in (config.get("architectures") or []):
        return "zlab"
    described = config.get("architectures") or config.get("model_type") or "no architecture"
    raise AuditError(f"{path}/config.json describes {described}, not a DFlash drafter "
                     "(no dflash_config, no speculators_model_type)")


# -- loading -----------------------------------------------------------------------------
def load_any(path: str | Path, target_dir: str | Path | None = None) -> LoadedCheckpoint:
    """Any drafter, normalized. `target_dir` (the verifier) tells a speculators drafter's verifier depth."""
    fmt = detect_format(path)
    loader = {"ours": load_ours, "zlab": load_zlab, "speculators": load_speculators}[fmt]
    return loader(Path(path), target_dir) if fmt == "speculators" else loader(Path(path))


def load_ours(path: Path) -> LoadedCheckpoint:
    ckpt = load_checkpoint(path)
    return LoadedCheckpoint(spec=ckpt.spec, state_dict=ckpt.state_dict, recipe=ckpt.recipe, step=ckpt.step,
                            optimizer=ckpt.optimizer, path=str(path), format="ours",
                            raw={"config": None, "layer_ids": list(ckpt.spec.target_layer_ids),
                                 "layer_id_convention": "zlab"})


def load_zlab(path: Path) -> LoadedCheckpoint:
    config = read_config(path)
    spec = spec_from_zlab_config(config, source=str(path / "config.json"))
    written = (config.get("dflash_config") or {}).get("target_layer_ids", config.get("target_layer_ids"))
    return LoadedCheckpoint(spec=spec, state_dict=read_safetensors_dir(path), path=str(path), format="zlab",
                            raw={"config": config, "layer_ids": written, "layer_id_convention": "zlab",
                                 "layer_ids_defaulted": written is None})


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
    return LoadedCheckpoint(spec=spec, state_dict=tensors, path=str(path), format="speculators", raw=raw,
                            verifier_tensors=verifier)
