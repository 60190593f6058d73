"""Our checkpoint, `ckpt.pt`, as a drafter: its spec, its recipe, its body and where training stood.

The file itself (entries, atomic write, `torch.load(weights_only=True)`, every entry checked) is
foundation/ckpt_file.py; the z-lab folder format is drafter_files/zlab_format.py; weights folders on disk are
foundation/weights_dir.py. Building a drafter from a body is impl/body_shapes.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from foundation.ckpt_file import CkptFile, read_ckpt, write_ckpt
from foundation.errors import CheckpointError
from impl.recipe import Recipe
from impl.spec import DraftSpec, SpecError

if TYPE_CHECKING:
    from impl.model import DFlashDrafter
# impl.model is not imported here: it pulls transformers' Qwen3 modeling (seconds), which the report writers and
# format detection never need (tests/test_restatements.py).


@dataclass
class Checkpoint:
    spec: DraftSpec
    state_dict: dict[str, torch.Tensor]
    recipe: Recipe | None = None
    step: int = 0
    # What resuming needs besides the weights: optimizer and scheduler state, RNG state, loss history.
    training_state: dict[str, Any] | None = None
    recipe_unknown: list[str] = field(default_factory=list)  # recipe fields the source never declared
    spec_written: frozenset[str] | None = None  # the spec fields the file states (None: not a ckpt.pt read back)


def save_checkpoint(path: str | Path, model: DFlashDrafter, recipe: Recipe | None = None, step: int = 0,
                    training_state: dict[str, Any] | None = None, recipe_unknown: list[str] | None = None) -> None:
    save_state(path, model.spec, {k: v.detach().cpu() for k, v in model.state_dict().items()}, recipe, step,
               training_state, recipe_unknown)


def save_state(path: str | Path, spec: DraftSpec, state_dict: dict[str, torch.Tensor], recipe: Recipe | None = None,
               step: int = 0, training_state: dict[str, Any] | None = None,
               recipe_unknown: list[str] | None = None) -> None:
    write_ckpt(path, spec.to_dict(), state_dict, recipe.to_dict() if recipe is not None else None, step,
               training_state, recipe_unknown)


def read_checkpoint(path: str | Path, file: CkptFile) -> Checkpoint:
    """A read `ckpt.pt`'s entries as a spec and a recipe; CheckpointError naming the file and the field."""
    try:
        spec = DraftSpec.from_dict(file.spec)
        recipe = Recipe.from_dict(file.recipe) if file.recipe else None
    except (SpecError, TypeError) as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    return Checkpoint(spec=spec, state_dict=file.model, recipe=recipe, step=file.step,
                      training_state=file.training_state, recipe_unknown=file.recipe_unknown,
                      spec_written=frozenset(file.spec))


def load_checkpoint(path: str | Path) -> Checkpoint:
    return read_checkpoint(path, read_ckpt(path))
