"""DeepSpeed checkpoints: a model-states file, a tag folder (`global_step10/`) or the folder above it
(following its `latest` file), as `engine.save_checkpoint` writes them.

ZeRO-1/2 keep the full weights in the model-states file (`module`). ZeRO-3 keeps 0-element
placeholders there: each parameter is split evenly (padded) across the data-parallel ranks, and
rank r's pieces of every parameter, in `param_shapes` order, sit end to end in that rank's
`fp32_flat_groups` of `*_optim_states.pt`. The full fp32 weights are rebuilt the way DeepSpeed's own
`zero_to_fp32` does: for each parameter take ceil(numel / ranks) elements from every rank at the
same offset, concatenate in rank order and cut the padding. All files are read by `safe_pickle`:
DeepSpeed's own classes (loss scalers) are read as data, never imported.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

from dflash_audit.formats.payload import EntryError, Payload, split_payload
from dflash_audit.formats.safe_pickle import UnsafePickle, safe_load, to_plain
from dflash_audit.formats.safe_yaml import describe
from foundation.errors import CheckpointError

MODEL_STATES = "model_states.pt"
OPTIM_STATES = "optim_states.pt"
RANK = re.compile(r"zero_pp_rank_(\d+)_")
MP_RANK = re.compile(r"mp_rank_(\d+)")
# Model-states entries that are the engine's bookkeeping, not declarations about the drafter.
BOOKKEEPING = {"buffer_names", "param_shapes", "frozen_param_shapes", "frozen_param_fragments", "shared_params",
               "ds_config", "ds_version", "dp_world_size", "mp_world_size", "skipped_steps", "global_steps",
               "global_samples", "sparse_tensor_module_names", "csr_tensor_module_names", "data_sampler",
               "random_ltd", "optimizer", "lr_scheduler", "zero_stage"}


def detect(path: Path) -> bool:
    if path.is_file():
        return path.name.endswith(MODEL_STATES)
    return path.is_dir() and ((path / "latest").is_file() or any(path.glob(f"*{MODEL_STATES}")))


def consolidate_hint(root: Path) -> str:
    return f"consolidate it with DeepSpeed's script: python zero_to_fp32.py {root} <output_dir>"


def tag_folder(path: Path) -> Path:
    """The folder holding the rank files: the path itself, or the tag its `latest` file names."""
    if path.is_file():
        return path.parent
    latest = path / "latest"
    if latest.is_file() and not any(path.glob(f"*{MODEL_STATES}")):
        tag = latest.read_text(encoding="utf-8", errors="replace").strip()
        folder = path / tag
        if not tag or "/" in tag or "\\" in tag or tag in (".", "..") or not folder.is_dir():
            raise CheckpointError(f"{latest}: names the tag {tag[:80]!r}, but there is no such folder in {path}; "
                                  "pass the tag folder (e.g. global_step100/) itself")
        return folder
    return path


def rank_of(path: Path) -> int:
    match = RANK.search(path.name)
    return int(match.group(1)) if match else 0


def model_states_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob(f"*{MODEL_STATES}"), key=rank_of)
    if not files:
        raise CheckpointError(f"{folder}: a DeepSpeed checkpoint folder with no *_{MODEL_STATES} file")
    parallel = sorted({m.group(0) for f in files for m in [MP_RANK.search(f.name)] if m and m.group(1) != "00"})
    if parallel:
        raise CheckpointError(f"{folder}: a tensor-parallel DeepSpeed checkpoint ({', '.join(parallel)}); "
                              f"{consolidate_hint(folder.parent)} and pass the output")
    return files


def load(path: Path) -> Any:
    try:
        data = safe_load(path)
    except UnsafePickle as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    except Exception as exc:  # truncated, not a torch file
        raise CheckpointError(f"{path}: not a readable DeepSpeed checkpoint file ({describe(exc)})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: holds a {type(data).__name__}, not a DeepSpeed checkpoint dict")
    return data


def read(path: Path, entry: str | None, entry_flag: str) -> tuple[Payload, list[Path], str]:
    """The drafter's state dict (ZeRO-3 rebuilt from its partitions), the files read, the layout's name."""
    folder = tag_folder(path)
    files = model_states_files(folder)
    model_file = path if path.is_file() else files[0]
    states = load(model_file)
    try:
        payload = split_payload(states, entry if entry is not None else ("module" if "module" in states else None),
                                entry_flag)
    except EntryError as exc:
        raise CheckpointError(f"{model_file}: {exc}") from exc
    payload.declarations = [(key, data) for key, data in payload.declarations
                            if key not in BOOKKEEPING and not set(data) <= BOOKKEEPING]
    for key in BOOKKEEPING:
        payload.ignored.pop(key, None)  # e.g. `random_ltd` is not RNG state, `optimizer` is None under ZeRO
    kept = [key for key in states if key in BOOKKEEPING and states[key] is not None]
    if kept:
        payload.ignored["DeepSpeed engine entries"] = ", ".join(kept)
    shapes = param_shapes(states)
    placeholders = [name for name, tensor in payload.tensors.items() if tensor.numel() == 0 and name in shapes]
    if not placeholders:
        stage = "DeepSpeed ZeRO-1/2 model states" if "param_shapes" in states else "DeepSpeed model states"
        return payload, [model_file], stage
    optim = sorted(folder.glob(f"*{OPTIM_STATES}"), key=rank_of)
    if not optim:
        raise CheckpointError(
            f"{model_file}: a DeepSpeed ZeRO-3 model-states file: its {len(placeholders)} parameters are 0-element "
            f"placeholders, and the *_{OPTIM_STATES} files that hold their partitions are not in {folder}; pass the "
            f"checkpoint folder that holds them, or {consolidate_hint(folder.parent if path.is_file() else path)}")
    rebuilt = rebuild_zero3(states, files, optim, folder)
    payload.tensors.update(rebuilt)  # param_shapes names parameters as `module` does
    payload.ignored.update({f.name: "ZeRO-3 partitions (fp32 weights read) and optimizer state" for f in optim})
    return payload, [model_file, *optim], f"DeepSpeed ZeRO-3 ({len(optim)} partitions, rebuilt as zero_to_fp32 does)"


def param_shapes(states: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    groups = states.get("param_shapes") or []
    if isinstance(groups, dict):
        groups = [groups]
    merged: dict[str, tuple[int, ...]] = {}
    for group in groups if isinstance(groups, list) else []:
        if isinstance(group, dict):
            merged.update({str(k): tuple(int(d) for d in v) for k, v in group.items()})
    return merged


def flat_partitions(optim: list[Path], folder: Path) -> tuple[list[torch.Tensor], int]:
    """Each rank's fp32 partition (its flat groups end to end) and the data-parallel world size."""
    root = folder.parent
    flats, stage, world = [], None, None
    for path in optim:
        state = load(path).get("optimizer_state_dict")
        if not isinstance(state, dict) or "fp32_flat_groups" not in state and "zero_stage" not in state:
            raise CheckpointError(f"{path}: not a DeepSpeed ZeRO optimizer-states file (no optimizer_state_dict "
                                  "with zero_stage)")
        # DeepSpeed pickles the stage as its own ZeroStageEnum: read as data, it is its integer.
        stage, world = to_plain(state.get("zero_stage")), to_plain(state.get("partition_count"))
        world = max(world) if isinstance(world, list) and world else world
        groups = state.get("fp32_flat_groups")
        if stage != 3 or not isinstance(groups, list) or not all(isinstance(g, torch.Tensor) for g in groups):
            raise CheckpointError(f"{path}: zero_stage {stage!r} without fp32_flat_groups, yet the model states hold "
                                  f"0-element placeholders; {consolidate_hint(root)}")
        flats.append(torch.cat([g.reshape(-1) for g in groups]) if groups else torch.empty(0))
    if not isinstance(world, int) or world != len(optim):
        raise CheckpointError(f"{folder}: partition_count {world!r}, but {len(optim)} *_{OPTIM_STATES} file(s) "
                              f"found (a rank's file is missing or left from another run); {consolidate_hint(root)}")
    if len({flat.numel() for flat in flats}) != 1:
        raise CheckpointError(f"{folder}: the ranks' fp32 partitions differ in size "
                              f"({sorted({f.numel() for f in flats})}); {consolidate_hint(root)}")
    return flats, world


def rebuild_zero3(states: dict[str, Any], model_files: list[Path], optim: list[Path],
                  folder: Path) -> dict[str, torch.Tensor]:
    flats, world = flat_partitions(optim, folder)
    rebuilt: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in param_shapes(states).items():
        numel = math.prod(shape)
        per_rank = math.ceil(numel / world)
        if offset + per_rank > flats[0].numel():
            break
        pieces = torch.cat([flat[offset:offset + per_rank] for flat in flats])
        rebuilt[name] = pieces[:numel].reshape(shape).clone()
        offset += per_rank
    if offset != flats[0].numel() or len(rebuilt) != len(param_shapes(states)):
        raise CheckpointError(f"{folder}: the parameters need {offset} elements per rank but each partition holds "
                              f"{flats[0].numel()}; {consolidate_hint(folder.parent)}")
    rebuilt.update(frozen_params(states, model_files))
    for alias, source in (states.get("shared_params") or {}).items():
        if source in rebuilt:
            rebuilt[str(alias)] = rebuilt[source]
    return rebuilt


def frozen_params(states: dict[str, Any], model_files: list[Path]) -> dict[str, torch.Tensor]:
    """Parameters that were not trained: each rank's model states hold its fragment of them."""
    shapes = states.get("frozen_param_shapes") or {}
    if not shapes:
        return {}
    fragments = [states.get("frozen_param_fragments") or {}] + [
        load(f).get("frozen_param_fragments") or {} for f in model_files[1:]]
    frozen = {}
    for name, shape in shapes.items():
        parts = [frag[name].reshape(-1) for frag in fragments if name in frag]
        numel = math.prod(tuple(shape))
        joined = torch.cat(parts) if parts else torch.empty(0)
        if joined.numel() < numel:
            continue  # not all ranks' fragments: left out, so the audit lists it as missing
        frozen[str(name)] = joined[:numel].reshape(tuple(shape)).clone()
    return frozen
