"""Our checkpoint, `ckpt.pt`: writing and reading it, checking a body against its settings, and
building a drafter from one.

Every write is atomic (temp file, then rename), so a crash never leaves a half-written
checkpoint. `ckpt.pt` is only ever read with `torch.load(weights_only=True)`. The z-lab folder
format is impl/zlab_format.py; weights folders on disk are foundation/weights_dir.py.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from foundation.atomic import atomic_write_bytes
from foundation.errors import CheckpointError
from impl.body_shapes import body_shapes
from impl.param_names import strip_wrapper_prefixes
from foundation.pickle_limits import PickleBomb, check_graph, load_failure_reason
from impl.recipe import Recipe
from impl.spec import DraftSpec, SpecError

if TYPE_CHECKING:
    from impl.model import DFlashDrafter
# impl.model is imported where a drafter is built, not here: it pulls transformers' Qwen3 modeling
# (seconds), which the report writers and format detection never need (tests/test_restatements.py).

CKPT_FORMAT = "dflash-audit/ckpt-1"


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


def check_body(spec: DraftSpec, state_dict: dict[str, torch.Tensor],
               source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """The body without wrapper prefixes, in the spec's parameter order, checked against the shapes the
    spec implies; one-line error naming the first bad tensor."""
    expected = body_shapes(spec)
    state_dict = strip_wrapper_prefixes(state_dict)
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if missing:
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in all)")
    for key, shape in expected.items():
        if tuple(state_dict[key].shape) != shape:
            raise CheckpointError(f"{source}: tensor {key!r} has shape {tuple(state_dict[key].shape)}, "
                                  f"the spec implies {shape}")
    return {key: state_dict[key] for key in expected}


def weights_dtype(state_dict: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype a body's weights are stored in (integer tensors such as a draft vocabulary's `d2t` say nothing)."""
    return next((t.dtype for t in state_dict.values() if t.is_floating_point()), torch.float32)


def build_drafter(spec: DraftSpec, state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                  source: str = "checkpoint") -> DFlashDrafter:
    """A drafter with exactly these weights; one-line error naming the first bad tensor."""
    from impl.model import DFlashDrafter

    state_dict = check_body(spec, state_dict, source)
    model = DFlashDrafter(spec)
    model.load_state_dict(state_dict)
    return model.to(dtype) if dtype is not None else model


# -- ours: ckpt.pt -----------------------------------------------------------------------
def save_checkpoint(path: str | Path, model: DFlashDrafter, recipe: Recipe | None = None, step: int = 0,
                    training_state: dict[str, Any] | None = None, recipe_unknown: list[str] | None = None) -> None:
    save_state(path, model.spec, {k: v.detach().cpu() for k, v in model.state_dict().items()}, recipe, step,
               training_state, recipe_unknown)


def save_state(path: str | Path, spec: DraftSpec, state_dict: dict[str, torch.Tensor], recipe: Recipe | None = None,
               step: int = 0, training_state: dict[str, Any] | None = None,
               recipe_unknown: list[str] | None = None) -> None:
    """`ckpt.pt` from a state dict: tensors backed by a file's pages (mmap) are written straight from them,
    never gathered into memory (torch.save writes each tensor's storage as it stands)."""
    payload = {
        "format": CKPT_FORMAT,
        "model": dict(state_dict),
        "spec": spec.to_dict(),
        "recipe": recipe.to_dict() if recipe is not None else None,
        "step": int(step),
    }
    if training_state is not None:
        payload["training_state"] = training_state
    if recipe_unknown:  # a converted checkpoint whose source never said these: unknown, not defaults
        payload["recipe_unknown"] = sorted(recipe_unknown)
    atomic_write_bytes(Path(path), lambda tmp: torch.save(payload, tmp))


# Spec fields renamed since ckpt.pt files were first written: the old key -> the field it is now.
RENAMED_SPEC_FIELDS = {"vocab_size": "target_vocab_size"}


def spec_entry(spec: Any) -> Any:
    """The `spec` entry with the fields' current names (a file written before a rename still loads)."""
    if not isinstance(spec, dict):
        return spec  # DraftSpec.from_dict names what is wrong with it
    renamed = {RENAMED_SPEC_FIELDS.get(key, key): value for key, value in spec.items()}
    return renamed if len(renamed) == len(spec) else spec  # both spellings at once: from_dict refuses the old one


def load_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        # mmap: the tensors stay pages of the file (read on use), so a 3 GB drafter costs no heap
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as exc:  # corrupt, truncated, or a pickle that is not plain data
        raise CheckpointError(f"{path}: not a readable ckpt.pt ({load_failure_reason(exc)})") from exc
    try:
        check_graph(payload)  # before anything walks it
    except PickleBomb as exc:
        raise CheckpointError(f"{path}: {exc}; refusing to read it further (nothing was run)") from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path}: expected a dict checkpoint, got {type(payload).__name__}")
    for key in ("model", "spec"):
        if key not in payload:
            raise CheckpointError(f"{path}: checkpoint has no {key!r} entry")
    written = spec_entry(payload["spec"])
    try:
        spec = DraftSpec.from_dict(written)
        recipe = Recipe.from_dict(payload["recipe"]) if payload.get("recipe") else None
    except (SpecError, TypeError) as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    model = payload["model"]
    if not isinstance(model, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in model.items()):
        raise CheckpointError(f"{path}: entry 'model' must map parameter names to tensors, got "
                              f"{type(model).__name__}")
    state = strip_wrapper_prefixes(model)
    unknown = payload.get("recipe_unknown") or []
    if not isinstance(unknown, list) or not all(isinstance(name, str) for name in unknown):
        raise CheckpointError(f"{path}: recipe_unknown must be a list of recipe field names")
    step = payload.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{path}: entry 'step' must be a non-negative integer, got {str(step)[:40]!r}")
    return Checkpoint(spec=spec, state_dict=state, recipe=recipe, step=step,
                      # "optimizer": the entry's name in ckpt.pt files written before it was "training_state"
                      training_state=payload.get("training_state", payload.get("optimizer")),
                      recipe_unknown=list(unknown), spec_written=frozenset(written))


