"""A Hugging Face config's rotary settings as the spec holds them, read the way transformers reads its rope dict.

Our trainer copies its target's rope so (impl/train.py), and the z-lab and speculators readers read a drafter's
config so (drafter_files/zlab_format.py, dflash_audit/formats/).
"""

from __future__ import annotations

from typing import Any

from foundation.config_values import as_float
from foundation.errors import SpecError
from impl.defaults import QWEN3_DEFAULTS, ROTARY_DEFAULTS
from impl.spec import LAYER_TYPES


def rope_mapping(config: dict[str, Any]) -> dict[str, Any]:
    """The rope dict a config states: `rope_parameters` (transformers 5), else the older `rope_scaling`; {} if none."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise SpecError("rope_parameters", f"{rope!r} is not a mapping")
    if "rope_theta" not in rope and set(rope) & set(LAYER_TYPES):
        # Per-layer-type rope (Laguna-style): speculators' `flatten_rope_parameters` runs the sliding one.
        rope = rope.get("sliding_attention") or rope.get("full_attention") or {}
        if not isinstance(rope, dict):
            raise SpecError("rope_parameters", f"{rope!r} is not a mapping")
    return rope


def rotary_settings(config: dict[str, Any]) -> dict[str, Any]:
    """rope_theta, rope_scaling, partial_rotary_factor and rope_style as transformers reads a config's rope dict
    (its values first, then the top-level fields, then Qwen3Config's defaults; `type` is the old spelling of
    `rope_type`)."""
    rope = rope_mapping(config)
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if kind != "default":
        scaling = {key: value for key, value in rope.items() if key not in ("rope_theta", "partial_rotary_factor", "type")}
        scaling["rope_type"] = kind
    neox = config.get("is_neox_style", True)
    if not isinstance(neox, bool):
        raise SpecError("is_neox_style", f"{neox!r} is not true or false")
    return {
        "rope_theta": as_float("rope_theta", rope["rope_theta"] if "rope_theta" in rope
                               else config.get("rope_theta", QWEN3_DEFAULTS["rope_theta"])),
        "rope_scaling": scaling,
        "partial_rotary_factor": as_float("partial_rotary_factor", rope.get(
            "partial_rotary_factor", config.get("partial_rotary_factor", ROTARY_DEFAULTS["partial_rotary_factor"]))),
        "rope_style": "neox" if neox else "gptj",
    }


def declared_rotary(config: dict[str, Any]) -> set[str]:
    """The rotary settings a config states itself (the others took a default)."""
    rope = rope_mapping(config)
    declared = {name for name in ("rope_theta", "partial_rotary_factor") if name in rope or name in config}
    if "rope_type" in rope or "type" in rope:
        declared.add("rope_scaling")
    if "is_neox_style" in config:
        declared.add("rope_style")
    return declared
