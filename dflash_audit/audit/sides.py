"""One side of a comparison: a drafter loaded from any format, with its raw on-disk values kept."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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


def load_side(path: str | Path, target_dir: str | Path | None = None) -> Side:
    """Detect the format and load; a path that is none of them is a one-line AuditError."""
    from dflash_audit.formats import load_any

    loaded = load_any(path, target_dir)
    raw = loaded.raw or {}
    # Belt and braces: a format loader that leaves verifier-owned tensors in the body.
    body = {k: v for k, v in loaded.state_dict.items() if k not in VERIFIER_OWNED}
    owned = {k: v for k, v in loaded.state_dict.items() if k in VERIFIER_OWNED} | dict(loaded.verifier_tensors)
    raw_ids = raw.get("layer_ids")
    return Side(path=str(path), format=loaded.format, spec=loaded.spec, state_dict=body, recipe=loaded.recipe,
                raw_layer_ids=list(raw_ids) if raw_ids is not None else list(loaded.spec.target_layer_ids),
                layer_id_convention=raw.get("layer_id_convention", "zlab"), verifier_tensors=owned,
                raw_config=raw.get("config") or {})
