"""The files beside the weights that a trainer's save writes (accelerate's `save_state`: `optimizer.bin`,
`scheduler.bin`, `scaler.pt`, `random_states_*.pkl`, `custom_checkpoint_*.pkl`; HF Trainer's
`optimizer.pt`, `scheduler.pt`, `rng_state*.pth`, `training_args.bin`): named in the report as what
they are, never read. The `.pkl` files are plain pickles: unpickling them could run code, so they
are only listed."""

from __future__ import annotations

import re
from pathlib import Path

ROLES = (
    (re.compile(r"^optimizer(_\d+)?\.(bin|pt|safetensors)$"), "optimizer state (not read)"),
    (re.compile(r"^(scheduler|lr_scheduler)(_\d+)?\.(bin|pt)$"), "scheduler state (not read)"),
    (re.compile(r"^scaler\.pt$"), "grad-scaler state (not read)"),
    (re.compile(r"^random_states_\d+\.pkl$"), "RNG state (a plain pickle: never unpickled)"),
    (re.compile(r"^rng_state(_\d+)?\.pth$"), "RNG state (not read)"),
    (re.compile(r"^custom_checkpoint_\d+\.pkl$"), "custom object state (a plain pickle: never unpickled)"),
    (re.compile(r"^sampler(_\d+)?\.bin$"), "data sampler state (not read)"),
    (re.compile(r"^training_args\.bin$"), "HF TrainingArguments (not read)"),
)


def role_of_file(name: str) -> str | None:
    return next((role for pattern, role in ROLES if pattern.match(name)), None)


def training_state_files(folder: Path) -> dict[str, str]:
    """file name -> what it is, for the trainer-state files of a checkpoint folder."""
    if not folder.is_dir():
        return {}
    return {p.name: role for p in sorted(folder.iterdir()) if p.is_file() for role in [role_of_file(p.name)] if role}
