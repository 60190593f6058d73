"""One side of a comparison: a drafter loaded from any format, with its raw on-disk values kept."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_audit.errors import AuditError
from impl.spec import DraftSpec, Recipe

# Copied from the verifier by speculators (PITFALLS #13): never trained, never draft body.
VERIFIER_OWNED = frozenset({"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                            "verifier_norm.weight", "t2d", "d2t"})


@dataclass
class Side:
    path: str
    format: str  # ours | zlab | speculators
    spec: DraftSpec
    state_dict: dict[str, torch.Tensor]  # draft body only
    recipe: Recipe | None
    raw_layer_ids: list[int]  # target layer ids as stored, in the format's own convention
    layer_id_convention: str  # "zlab" (hs[id + 1]) or "speculators" (hs[id])
    verifier_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    raw_config: dict[str, Any] = field(default_factory=dict)


def split_verifier_owned(state_dict: dict[str, torch.Tensor]):
    body = {k: v for k, v in state_dict.items() if k not in VERIFIER_OWNED}
    owned = {k: v for k, v in state_dict.items() if k in VERIFIER_OWNED}
    return body, owned


def load_side(path: str | Path) -> Side:
    """Detect the format and load; a path that is none of them is a one-line AuditError."""
    path = Path(path)
    if not path.exists():
        raise AuditError(f"{path}: no such file or directory")
    try:
        from dflash_audit.formats import load_any
    except ModuleNotFoundError:  # until the adapters' loader lands: ours and z-lab only
        load_any = _load_ours_or_zlab
    return _side_from_loaded(path, load_any(path))


@dataclass
class _Loaded:
    format: str
    checkpoint: Any


def _load_ours_or_zlab(path: Path) -> _Loaded:
    from impl.checkpoint import load_checkpoint, load_zlab_dir

    if path.is_file():
        return _Loaded("ours", load_checkpoint(path))
    raw = _read_raw_config(path)
    if raw.get("speculators_model_type"):
        raise AuditError(f"{path}: speculators format needs dflash_audit.formats, which is not installed")
    return _Loaded("zlab", load_zlab_dir(path))


def _side_from_loaded(path: Path, loaded) -> Side:
    fmt = loaded.format
    checkpoint = loaded.checkpoint if hasattr(loaded, "checkpoint") else loaded
    body, owned = split_verifier_owned(checkpoint.state_dict)
    owned.update(getattr(loaded, "verifier_tensors", None) or {})
    raw_config = getattr(loaded, "raw_config", None) or _read_raw_config(path)
    raw_ids = getattr(loaded, "raw_layer_ids", None)
    if raw_ids is None:
        dflash_config = raw_config.get("dflash_config") or {}
        raw_ids = (raw_config.get("aux_hidden_state_layer_ids") or dflash_config.get("target_layer_ids")
                   or list(checkpoint.spec.target_layer_ids))
    convention = "speculators" if fmt == "speculators" else "zlab"
    return Side(path=str(path), format=fmt, spec=checkpoint.spec, state_dict=body, recipe=checkpoint.recipe,
                raw_layer_ids=list(raw_ids), layer_id_convention=convention, verifier_tensors=owned,
                raw_config=raw_config)


def _read_raw_config(path: Path) -> dict[str, Any]:
    config = path / "config.json"
    if path.is_dir() and config.is_file():
        try:
            return json.loads(config.read_text())
        except json.JSONDecodeError:
            return {}
    return {}
