"""The `ckpt.pt` container: the entries our trainer writes (`model`, `spec`, `recipe`, `step`, `training_state`,
`recipe_unknown`), written atomically and read back with `torch.load(weights_only=True)` only, every entry checked
before anything uses it. The spec and the recipe stay plain mappings here; drafter_files/checkpoint.py reads them as
a `DraftSpec` and a `Recipe`.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from foundation.atomic import atomic_write_bytes
from foundation.decompression import MAX_EXPANDED_BYTES, DecompressionBomb, check_zip
from foundation.errors import CheckpointError
from foundation.inputs import openable
from foundation.param_names import strip_wrapper_prefixes
from foundation.pickle_limits import PickleBomb, check_graph, load_failure_reason

CKPT_FORMAT = "dflash-audit/ckpt-1"
# Spec fields renamed since ckpt.pt files were first written: the old key -> the field it is now.
RENAMED_SPEC_FIELDS = {"vocab_size": "target_vocab_size"}


@dataclass
class CkptFile:
    spec: Any  # the spec's fields by name (current names), as written
    model: dict[str, torch.Tensor]  # without wrapper prefixes
    recipe: Any = None
    step: int = 0
    training_state: dict[str, Any] | None = None
    recipe_unknown: list[str] = field(default_factory=list)


def write_ckpt(path: str | Path, spec: dict[str, Any], state_dict: dict[str, torch.Tensor],
               recipe: dict[str, Any] | None = None, step: int = 0, training_state: dict[str, Any] | None = None,
               recipe_unknown: list[str] | None = None) -> None:
    """`ckpt.pt`: tensors backed by a file's pages (mmap) are written straight from them, never gathered into
    memory (torch.save writes each tensor's storage as it stands)."""
    payload = {"format": CKPT_FORMAT, "model": dict(state_dict), "spec": spec, "recipe": recipe, "step": int(step)}
    if training_state is not None:
        payload["training_state"] = training_state
    if recipe_unknown:  # a converted checkpoint whose source never said these: unknown, not defaults
        payload["recipe_unknown"] = sorted(recipe_unknown)
    atomic_write_bytes(Path(path), lambda tmp: torch.save(payload, tmp))


def spec_entry(spec: Any) -> Any:
    """The `spec` entry with the fields' current names (a file written before a rename still loads)."""
    if not isinstance(spec, dict):
        return spec  # DraftSpec.from_dict names what is wrong with it
    renamed = {RENAMED_SPEC_FIELDS.get(key, key): value for key, value in spec.items()}
    return renamed if len(renamed) == len(spec) else spec  # both spellings at once: from_dict refuses the old one


def read_ckpt(path: str | Path) -> CkptFile:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        zipped = zipfile.is_zipfile(path)
        if zipped:
            check_zip(openable(path), MAX_EXPANDED_BYTES)
        # mmap: the tensors stay pages of the file (read on use), so a 3 GB drafter costs no heap
        payload = torch.load(openable(path), map_location="cpu", weights_only=True, mmap=zipped)
    except DecompressionBomb as exc:
        raise CheckpointError(f"{path}: {exc}") from None
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
    model = payload["model"]
    if not isinstance(model, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in model.items()):
        raise CheckpointError(f"{path}: entry 'model' must map parameter names to tensors, got "
                              f"{type(model).__name__}")
    unknown = payload.get("recipe_unknown") or []
    if not isinstance(unknown, list) or not all(isinstance(name, str) for name in unknown):
        raise CheckpointError(f"{path}: recipe_unknown must be a list of recipe field names")
    step = payload.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{path}: entry 'step' must be a non-negative integer, got {str(step)[:40]!r}")
    return CkptFile(spec=spec_entry(payload["spec"]), model=strip_wrapper_prefixes(model),
                    recipe=payload.get("recipe"),
                    # "optimizer": the entry's name in ckpt.pt files written before it was "training_state"
                    training_state=payload.get("training_state", payload.get("optimizer")),
                    recipe_unknown=list(unknown), step=step)
