"""A Hugging Face weights folder on disk: its config.json, its `model.safetensors` or the shards its
index names (each checked to lie inside the folder and to exist)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from foundation.errors import CheckpointError


def index_shards(index: Path) -> list[Path]:
    """The shard files a `*.index.json` names; each must lie inside the index's own folder."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{index}: invalid JSON ({exc.__class__.__name__})") from exc
    except (KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index}: no 'weight_map' object naming the shards") from exc
    folder = index.parent.resolve()
    files = []
    for name in names:
        if not isinstance(name, str):
            raise CheckpointError(f"{index}: weight_map names a non-string shard {name!r}")
        shard = (index.parent / name).resolve()
        if shard.parent != folder:
            raise CheckpointError(f"{index}: weight_map names {name!r}, outside the index's own folder; refused")
        if not shard.is_file():
            raise CheckpointError(f"{index}: shard {name!r} is missing")
        files.append(shard)
    return files


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors` or of the shards named by its index."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [shard.name for shard in index_shards(index)]
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{path}: no model.safetensors (or index) in the directory")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            with safe_open(str(path / name), framework="pt") as handle:
                for key in handle.keys():
                    tensors[key] = handle.get_tensor(key)
        except Exception as exc:
            raise CheckpointError(f"{path / name}: unreadable safetensors file ({str(exc)[:200]})") from exc
    return tensors


def read_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path}: no config.json")
    try:
        return json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path}: invalid JSON ({exc})") from exc
