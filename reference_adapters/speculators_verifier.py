"""What speculators' `load_verifier_weights` will read from a local verifier folder, checked before anything loads.

speculators 0.9.0 reloads a DFlash drafter's embeddings and final norm (and its head, falling
back to the embeddings) from the verifier through `speculators.utils.loading.load_model_layers`:
it reads `model.safetensors.index.json` (else `model.safetensors`), resolves each name with its
own `_resolve_key` (exact, suffix, alias) and opens the shard holding it. A folder with only a
config fails there, after the drafter was built; this reads the same index with the same
resolver, opening only safetensors headers.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from speculators.utils.loading import _resolve_key  # the resolver load_model_layers itself uses

from foundation.inputs import openable

# Names DFlashDraftModel.load_verifier_weights asks for; the head may be absent (tied to the embeddings).
REQUIRED = ("embed_tokens.weight", "model.norm.weight")
OPTIONAL = ("lm_head.weight",)


def weight_map(folder: Path) -> tuple[dict[str, str] | None, str]:
    """(name -> shard file, where it was read), or (None, what is missing)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            mapping = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            return None, f"{index.name} is unreadable or has no weight_map ({type(exc).__name__})"
        if not isinstance(mapping, dict):
            return None, f"{index.name}: weight_map is not an object"
        return mapping, index.name
    single = folder / "model.safetensors"
    if single.is_file():
        try:
            with safe_open(openable(single), framework="pt") as handle:
                return dict.fromkeys(handle.keys(), single.name), single.name
        except Exception as exc:  # truncated or not safetensors
            return None, f"{single.name} is unreadable ({str(exc)[:120]})"
    return None, "no model.safetensors.index.json and no model.safetensors (the weights)"


def missing_verifier_weights(folder: str | Path) -> list[str]:
    """What speculators would fail to load from `folder`; [] when every tensor it needs is there."""
    folder = Path(folder)
    mapping, where = weight_map(folder)
    if mapping is None:
        return [where]
    problems = []
    for name in REQUIRED + OPTIONAL:
        key = _resolve_key(name, mapping)
        if key is None:
            if name in REQUIRED:
                problems.append(f"{where} names no {name!r}")
            continue
        shard = folder / str(mapping[key])
        if shard.resolve().parent != folder.resolve():
            problems.append(f"{where} puts {key!r} in {mapping[key]!r}, outside the folder")
        elif not shard.is_file():
            problems.append(f"{where} puts {key!r} in {mapping[key]!r}, which is missing")
    return problems
