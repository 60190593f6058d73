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

# The reference each format is written for (the code that trains or runs a drafter in it).
FORMAT_REFERENCE = {"zlab": "z-lab's DFlashDraftModel (dflash 0.1.0)", "speculators": "speculators 0.9.0"}
TRAINER_DROPS_FACTOR = {"speculators": " (and its trainer drops a verifier's factor from the draft config unless the "
                                       "rope has an mrope_section: train/cli.py)"}


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


def applied_settings(fmt: str, declared: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """What the reference of format `fmt` (zlab, speculators) applies of the rotary settings `declared` (ROTARY_FIELDS),
    and why each differs: the static audit holds a side's declared settings to these (#35), `serve-check` an
    engine's on a folder of that format."""
    reference, why = FORMAT_REFERENCE[fmt], {}
    values = dict(declared)
    if declared["rope_style"] != "neox":
        values["rope_style"] = "neox"
        why["rope_style"] = f"{reference} rotates neox style only (rotate_half)"
    if declared["partial_rotary_factor"] != 1.0:
        if declared["rope_scaling"] is None:
            values["partial_rotary_factor"] = 1.0
            why["partial_rotary_factor"] = (f"{reference} builds transformers' Qwen3RotaryEmbedding, whose default "
                                            "rope ignores the factor: every head dim is rotated"
                                            + TRAINER_DROPS_FACTOR.get(fmt, ""))
        else:
            values["partial_rotary_factor"] = None  # no value: the reference cannot run it
            why["partial_rotary_factor"] = (f"{reference} cannot run it: the scaled rope's cos/sin cover only the "
                                            "rotated dims and its apply_rotary_pos_emb rotates the whole head")
    return values, why
