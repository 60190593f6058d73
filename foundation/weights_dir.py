"""A Hugging Face weights folder on disk: its config.json, its `model.safetensors` or the shards its
index names (each checked to lie inside the folder and to exist)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from foundation.errors import CheckpointError
from foundation.inputs import openable, read_json_object


def index_shards(index: Path) -> list[Path]:
    """The shard files a `*.index.json` names, as paths in the index's own folder. Each name must stay in
    that folder; a shard that is a symbolic link must resolve to a regular file inside the folder or, in
    a Hugging Face hub cache (`<repo>/snapshots/<rev>/` linking into `<repo>/blobs/`), inside its blobs."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{index}: not valid UTF-8 JSON ({' '.join(str(exc).split())[:120]})") from exc
    except RecursionError:
        raise CheckpointError(f"{index}: JSON nested too deeply to read") from None
    except (KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index}: no 'weight_map' object naming the shards") from exc
    folder = index.parent
    files = []
    for name in names:
        if not isinstance(name, str):
            raise CheckpointError(f"{index}: weight_map names a non-string shard {name!r}")
        shard = folder / name
        if not name or os.path.isabs(name) or os.path.normpath(name).startswith("..") or "/" in os.path.normpath(name):
            raise CheckpointError(f"{index}: weight_map names {name!r}, outside the index's own folder; refused")
        if shard.is_symlink() and not _inside(Path(os.path.realpath(shard)), allowed_roots(folder)):
            raise CheckpointError(f"{index}: shard {name!r} links to {os.path.realpath(shard)}, outside the "
                                  "index's own folder and any hub cache's blobs; refused")
        if not shard.exists():
            raise CheckpointError(f"{index}: shard {name!r} is missing")
        if not shard.is_file():
            raise CheckpointError(f"{index}: shard {name!r} is not a regular file (a directory, FIFO or device)")
        files.append(shard)
    return files


def allowed_roots(folder: Path) -> list[Path]:
    """Where a shard's link may lead: the folder itself, and `<repo>/blobs` of a hub snapshot folder."""
    roots = [Path(os.path.realpath(folder))]
    real = Path(os.path.realpath(folder))
    if real.parent.name == "snapshots":
        roots.append(real.parent.parent / "blobs")
    return roots


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors` or of the shards named by its index."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [shard.name for shard in index_shards(index)]
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif (path / "model.safetensors").exists():
        raise CheckpointError(f"{path / 'model.safetensors'}: not a regular file (a directory, FIFO or device)")
    else:
        raise CheckpointError(f"{path}: no model.safetensors (or index) in the directory")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            with safe_open(openable(path / name), framework="pt") as handle:
                for key in handle.keys():
                    tensors[key] = handle.get_tensor(key)
        except Exception as exc:
            raise CheckpointError(f"{path / name}: unreadable safetensors file ({str(exc)[:200]})") from exc
    return tensors


def read_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path}: no config.json")
    return read_json_object(config_path, "config.json", CheckpointError)
