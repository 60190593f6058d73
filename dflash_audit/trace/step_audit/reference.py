"""The reference a trace is held to: the layer ids fc reads (`--ref`'s `target_layer_ids`, else z-lab's
`build_target_layer_ids` for the target's and the drafter's depth), the block size and the mask id (`--ref`'s, else the
drafter's own declared ones). The recipe's reference is chosen later, from what the trainer was found to do
(recipe.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundation.config_values import as_int
from foundation.errors import AuditError, SpecError
from foundation.inputs import read_json_object


@dataclass
class Reference:
    layer_ids: list[int]
    layer_source: str
    block_size: int | None
    block_source: str
    mask_token_id: int | None
    mask_source: str


def read_ref(path: Path | None) -> dict[str, Any]:
    """`--ref`: a config.json (or a folder holding one) declaring target_layer_ids / block_size / mask_token_id,
    at its top level or under `dflash_config`."""
    if path is None:
        return {}
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise AuditError(f"--ref {path}: no config.json there")
    data = read_json_object(file, "config.json", lambda message: AuditError(f"--ref {message}"))
    nested = data.get("dflash_config") if isinstance(data.get("dflash_config"), dict) else {}
    found = {name: nested.get(name, data.get(name)) for name in ("target_layer_ids", "block_size", "mask_token_id")}
    found = {k: v for k, v in found.items() if v is not None}
    if not found:
        raise AuditError(f"--ref {file}: declares none of target_layer_ids, block_size, mask_token_id")
    try:  # read strictly: the ids a list of whole numbers, the block and the mask id whole numbers of their range
        if "target_layer_ids" in found:
            ids = found["target_layer_ids"]
            if not isinstance(ids, list) or not ids:
                raise SpecError("target_layer_ids", f"{ids!r:.60} is not a list of layer ids")
            found["target_layer_ids"] = [as_int("target_layer_ids", i) for i in ids]
            if min(found["target_layer_ids"]) < 0:
                raise SpecError("target_layer_ids", f"{ids!r:.60} holds a negative layer id")
        for name, least in (("block_size", 1), ("mask_token_id", 0)):
            if name in found and as_int(name, found[name]) < least:
                raise SpecError(name, f"{found[name]!r} is below {least}")
    except SpecError as exc:
        raise AuditError(f"--ref {file}: {exc}") from None
    return {"file": str(file), **found}


def reference_for(drafter_facts: dict, target_layers: int, ref: dict, depth_from: str | None = None) -> Reference:
    """`depth_from`: where the drafter's depth was read when its config declares none (recorder.py's
    `depth_from_modules`), said in the layer ids' source."""
    from reference_adapters.zlab_adapter import ZlabImplementation
    from foundation.packages import installed_version

    draft_layers = drafter_facts.get("num_hidden_layers")
    if "target_layer_ids" in ref:
        ids, source = [int(i) for i in ref["target_layer_ids"]], f"--ref {ref['file']}"
    elif draft_layers:
        ids = ZlabImplementation().default_target_layer_ids(target_layers, int(draft_layers))
        read = f" (read from {depth_from})" if depth_from else ""
        source = (f"for {target_layers} target layers and {draft_layers} draft layers{read}, z-lab's "
                  f"build_target_layer_ids (dflash {installed_version('dflash')})")
    else:
        ids, source = [], ("unknown: the drafter declares no depth, its modules hold no one list of attention blocks "
                           "to read it from, and no --ref was given")
    block = ref.get("block_size", drafter_facts.get("block_size"))
    block_source = f"--ref {ref['file']}" if "block_size" in ref else "the drafter's config"
    mask = ref.get("mask_token_id", drafter_facts.get("mask_token_id"))
    mask_source = f"--ref {ref['file']}" if "mask_token_id" in ref else "the drafter's config"
    return Reference(ids, source, int(block) if block is not None else None, block_source,
                     int(mask) if mask is not None else None, mask_source)
