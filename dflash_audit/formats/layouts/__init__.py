"""The layouts training frameworks save in, each opened into the foreign loader's `Payload`.

| layout | module |
|---|---|
| torch.distributed.checkpoint folder (`.metadata` + `*.distcp`) | `dcp` |
| DeepSpeed model states, tag folder, folder with `latest` (ZeRO-3 rebuilt from its partitions) | `deepspeed` |
| Megatron `iter_*/mp_rank_00/model_optim_rng.pt`, folder with `latest_checkpointed_iteration.txt` | `megatron` |
| NeMo `.nemo` archive (`model_weights.ckpt` + `model_config.yaml`) | `archives` |
| trainer-state files beside the weights (accelerate `save_state`, HF Trainer) | `accelerate` |
| Hydra `.hydra/` and Lightning `hparams.yaml` configs around a checkpoint | `nested_config` |

A path no layout claims is read by `foreign.py` as plain weight files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_audit.formats.layouts import (
    accelerate,
    archives,
    dcp,
    deepspeed,
    megatron,
    nested_config,
)
from dflash_audit.formats.payload import Payload
from dflash_audit.formats.weight_file import read_weight_file

# Files whose presence means a folder holds full model weights (read as such, before any layout).
MODEL_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                 "pytorch_model.bin.index.json")

__all__ = ["Opened", "accelerate", "detect", "nested_config", "open_layout"]


@dataclass
class Opened:
    payload: Payload
    files: list[Path]  # every file read
    layout: str  # what the report calls it
    declarations: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (label, data) inside the layout


def has_model_weights(folder: Path) -> bool:
    return any((folder / name).is_file() for name in MODEL_WEIGHTS)


def detect(path: Path) -> str | None:
    """The layout `path` is in, or None for plain weight files (or nothing known)."""
    if dcp.detect(path):
        return "torch.distributed.checkpoint"
    if path.is_dir() and has_model_weights(path):
        return None
    if megatron.detect(path):
        return "Megatron"
    if deepspeed.detect(path):
        return "DeepSpeed"
    if archives.detect(path):
        return "NeMo archive"
    return None


def open_layout(path: Path, entry: str | None, entry_flag: str) -> Opened | None:
    layout = detect(path)
    if layout is None:
        return None
    if layout == "torch.distributed.checkpoint":
        payload, files = dcp.read(path, entry, entry_flag)
        declarations, common = megatron.common_state(path, payload)  # an iter_* folder of Megatron's torch_dist
        return Opened(payload, files + common, layout, declarations)
    if layout == "Megatron":
        resolved = megatron.resolve(path)
        if dcp.detect(resolved):
            payload, files = dcp.read(resolved, entry, entry_flag)
            declarations, common = megatron.common_state(resolved, payload)
            return Opened(payload, files + common, "Megatron torch_dist (torch.distributed.checkpoint)", declarations)
        return Opened(read_weight_file(resolved, entry, entry_flag), [resolved],
                      f"Megatron ({resolved.parent.name}/{resolved.name})")
    if layout == "DeepSpeed":
        payload, files, name = deepspeed.read(path, entry, entry_flag)
        return Opened(payload, files, name)
    payload, declarations = archives.read(path, entry, entry_flag)
    return Opened(payload, [path], layout, declarations)
