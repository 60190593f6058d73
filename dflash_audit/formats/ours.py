"""Our own format: `ckpt.pt` as our trainer writes it (`drafter_files.checkpoint`), spec and recipe inside."""

from __future__ import annotations

import zipfile
from pathlib import Path

from dflash_audit.formats.foreign import PICKLE_SUFFIXES
from dflash_audit.formats.shape_inference import Provenance
from dflash_audit.formats.loaded import LoadedCheckpoint, RawRecord, declared_provenance
from foundation.ckpt_file import CKPT_FORMAT
from impl.body_shapes import check_body, weights_dtype
from drafter_files.checkpoint import load_checkpoint, save_state
from impl.recipe import Recipe
from impl.spec import ROTARY_FIELDS


def detect(path: Path) -> bool:
    """Whether a pickle file carries our trainer's format tag (read from its bytes, nothing unpickled)."""
    if not path.name.endswith(PICKLE_SUFFIXES):
        return False
    marker = CKPT_FORMAT.encode()
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
                return name is not None and marker in archive.read(name)
        with open(path, "rb") as handle:
            return marker in handle.read(1 << 20)
    except (OSError, zipfile.BadZipFile):
        return False


def load(path: Path) -> LoadedCheckpoint:
    ckpt = load_checkpoint(path)
    return LoadedCheckpoint(spec=ckpt.spec, state_dict=ckpt.state_dict, recipe=ckpt.recipe, step=ckpt.step,
                            training_state=ckpt.training_state, recipe_unknown=ckpt.recipe_unknown, path=str(path), format="ours",
                            raw=RawRecord(layer_ids=list(ckpt.spec.target_layer_ids)),
                            provenance=provenance(ckpt, path.name))


def provenance(ckpt, name: str) -> dict:
    """Every field declared by the file's spec, except rotary settings written before they existed: those are our
    drafter's defaults of that time (every head dim rotated, neox, unscaled), which is what it trained with."""
    found = declared_provenance(ckpt.spec, f"{name}: spec")
    for field_name in ROTARY_FIELDS:
        if ckpt.spec_written is not None and field_name not in ckpt.spec_written:
            found[field_name] = Provenance("default", f"not in {name}'s spec (written before the field existed); "
                                                      "our trainer then always used this default")
    return found


def save(loaded: LoadedCheckpoint, destination: Path) -> None:
    """`ckpt.pt` with the same weights (and dtype); recipe fields the source never declared stay unknown."""
    dtype = weights_dtype(loaded.state_dict)
    body = check_body(loaded.spec, loaded.state_dict, source=loaded.path)  # shapes checked on meta: no copy
    # One dtype for the weights, tensor by tensor; a draft vocabulary's integer d2t stays integer.
    body = {k: v if v.dtype == dtype or not v.is_floating_point() else v.to(dtype) for k, v in body.items()}
    recipe = loaded.recipe if loaded.recipe is not None or not loaded.recipe_unknown else Recipe()
    save_state(destination, loaded.spec, body, recipe=recipe, step=loaded.step, recipe_unknown=loaded.recipe_unknown)
