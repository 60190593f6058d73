"""Megatron-style checkpoints: `iter_0000100/mp_rank_00/model_optim_rng.pt`, or the folder above it whose
`latest_checkpointed_iteration.txt` names the iteration. One model-parallel rank is read as a training
file; a checkpoint split across ranks is refused, naming them (merging them is Megatron's job)."""

from __future__ import annotations

import re
from pathlib import Path

from foundation.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
RANK_FOLDER = re.compile(r"^mp_rank_\d{2}(_\d{3})?$")
FILES = ("model_optim_rng.pt", "model_rng.pt")


def rank_folders(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and RANK_FOLDER.match(p.name))


def detect(path: Path) -> bool:
    return path.is_dir() and ((path / TRACKER).is_file() or bool(rank_folders(path)))


def iteration_folder(path: Path) -> Path:
    tracker = path / TRACKER
    if not tracker.is_file():
        return path
    text = tracker.read_text(encoding="utf-8", errors="replace").strip()
    name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
    if name is None or not (path / name).is_dir():
        raise CheckpointError(f"{tracker}: names iteration {text[:40]!r}, but there is no such folder in {path}; "
                              "pass the iteration folder (iter_NNNNNNN/) itself")
    return path / name


def resolve(path: Path) -> Path:
    """The folder to read: a DCP folder (Megatron's torch_dist format) or the one rank's training file."""
    folder = iteration_folder(path)
    if (folder / ".metadata").is_file():
        return folder
    ranks = rank_folders(folder)
    if not ranks:
        found = sorted(p.name for p in folder.iterdir())[:6]
        raise CheckpointError(f"{folder}: a Megatron checkpoint folder with no mp_rank_00/ in it (found {found})")
    if len(ranks) > 1:
        raise CheckpointError(f"{folder}: a Megatron checkpoint split across {len(ranks)} model-parallel ranks "
                              f"({', '.join(r.name for r in ranks[:4])}); merge them into one rank (Megatron's "
                              "checkpoint converter, tensor and pipeline parallel size 1) and pass the merged file")
    for name in FILES:
        if (ranks[0] / name).is_file():
            return ranks[0] / name
    raise CheckpointError(f"{ranks[0]}: no {' or '.join(FILES)} in the rank folder")


def common_state(folder: Path, payload) -> tuple[list[tuple[str, dict]], list[Path]]:
    """Megatron's torch_dist format keeps what is not sharded (`args`, iteration, RNG and optimizer
    bookkeeping) in `common.pt` beside the DCP files: its args are declarations, the rest is named."""
    from dflash_audit.formats.layouts.deepspeed import load
    from dflash_audit.formats.payload import role_of
    from dflash_audit.formats.safe_pickle import to_plain

    common = folder / "common.pt"
    if not common.is_file():
        return [], []
    declarations = []
    for key, value in load(common).items():
        role = role_of(str(key), value)
        if role:
            payload.ignored[f"common.pt: {key}"] = role
        else:
            plain = to_plain(value)
            declarations.append(("common.pt:", {str(key): plain}))
    return declarations, [common]
