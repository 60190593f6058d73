"""z-lab's format: a Hugging Face directory, `config.json` with `dflash_config`, `model.safetensors`, read and
written by drafter_files/zlab_format.py; here what the audit adds: detection and each field's provenance.

A DFlash2 directory says `architectures: ["DFlash2DraftModel"]`, keeps the convolution and
selector sizes in `dflash_config` and stores the selector's codebooks without `.weight`
(z-lab's `from_pretrained` maps them onto its Embeddings)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_audit.formats.shape_inference import Provenance
from dflash_audit.formats.loaded import (
    LoadedCheckpoint,
    RawRecord,
    declared_provenance,
    rotary_provenance,
)
from impl.body_shapes import check_body
from impl.families import is_zlab_architecture
from drafter_files.zlab_format import read_zlab_dir, save_zlab_dir

# A z-lab config without rope_theta runs at transformers' Qwen3Config default (not Qwen3's published 1e6).
ZLAB_THETA_DEFAULT = "transformers' Qwen3Config default, which z-lab's DFlashDraftModel reads it with"


def detect(config: dict[str, Any]) -> bool:
    """A z-lab DFlash (`DFlashDraftModel`) or DFlash2 (`DFlash2DraftModel`) directory."""
    return "dflash_config" in config or is_zlab_architecture(config)


def load(path: Path) -> LoadedCheckpoint:
    config, spec, state = read_zlab_dir(path)
    written = (config.get("dflash_config") or {}).get("target_layer_ids", config.get("target_layer_ids"))
    provenance = declared_provenance(spec, "config.json", config_keys(config))
    if "sample_from_anchor" not in (config.get("dflash_config") or {}):
        provenance["sample_from_anchor"] = Provenance("inferred", "not in config.json; z-lab's dflash has one slot "
                                                                  "layout, the anchor as the bonus token")
    rotary_provenance(provenance, config, "config.json", ZLAB_THETA_DEFAULT)
    if written is None:
        provenance["target_layer_ids"] = Provenance("default", "not in config.json; z-lab's build_target_layer_ids")
    return LoadedCheckpoint(spec=spec, state_dict=state, path=str(path), format="zlab",
                            raw=RawRecord(config=config, layer_ids=written, layer_ids_defaulted=written is None),
                            provenance=provenance)


def config_keys(config: dict[str, Any]) -> set[str]:
    """Spec fields a z-lab (or z-lab-shaped) config.json states itself."""
    present = set(config) | set(config.get("dflash_config") or {})
    if "use_sliding_window" in config:
        present.add("sliding_window")
    if "is_causal" in config:
        present.add("sliding_window_non_causal")
    return present


def save(loaded: LoadedCheckpoint, destination: Path) -> None:
    body = check_body(loaded.spec, loaded.state_dict, source=loaded.path)  # one-line error on a bad body
    save_zlab_dir(destination, loaded.spec, body)  # written from the source's pages, tensor by tensor
