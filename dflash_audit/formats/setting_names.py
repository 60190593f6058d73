"""The names under which checkpoints, configs and training args declare a drafter's settings.

One table maps every recognized name (z-lab's, speculators' `TrainConfig` and model config,
and the common ones teams use) to a `DraftSpec` or `Recipe` field. Declared dicts are
walked recursively; a key is recognized by its last path component, so `args.gamma`,
`train.loss.gamma` and `dflash_config.block_size` all count. Keys under a target/verifier
scope describe the target (`target.num_hidden_layers` is the target's depth). Whatever is
not recognized is kept verbatim for the report.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from impl.layers import speculators_to_zlab
from impl.recipe import KNOBS, LOSS_KINDS, LOSS_WEIGHTINGS, canonical_loss_fn, choices
from impl.spec import LAYER_TYPES, ROPE_STYLES

SPEC_NAMES = {
    "hidden_size": ("hidden_size", "hidden_dim", "d_model", "n_embd", "dim"),
    "intermediate_size": ("intermediate_size", "ffn_dim", "ffn_hidden_size", "mlp_dim"),
    "num_attention_heads": ("num_attention_heads", "num_heads", "n_heads", "n_head"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "n_kv_heads"),
    "head_dim": ("head_dim",),
    "num_hidden_layers": ("num_hidden_layers", "num_draft_layers", "draft_layers", "n_draft_layers", "num_layers",
                          "n_layers", "draft_num_layers"),
    "target_vocab_size": ("target_vocab_size", "vocab_size"),
    "target_layer_ids": ("target_layer_ids", "target_layers", "fc_layers", "fc_layer_ids", "layer_ids",
                         "feature_layers", "context_layers", "aux_hidden_state_layer_ids"),
    "num_target_layers": ("num_target_layers", "target_num_layers", "num_target_hidden_layers",
                          "target_num_hidden_layers", "verifier_num_layers"),
    "mask_token_id": ("mask_token_id", "mask_id", "mask_token"),
    "block_size": ("block_size", "draft_block_size", "block_len"),
    "layer_types": ("layer_types",),
    "sliding_window": ("sliding_window",),
    "rope_theta": ("rope_theta",),
    "partial_rotary_factor": ("partial_rotary_factor",),
    "rms_norm_eps": ("rms_norm_eps",),
    "max_position_embeddings": ("max_position_embeddings",),
    "attention_bias": ("attention_bias",),
    "hidden_act": ("hidden_act",),
    "input_embedding_scale": ("input_embedding_scale",),
    "output_multiplier": ("output_multiplier",),
    "final_logit_softcapping": ("final_logit_softcapping",),
    "sliding_window_non_causal": ("sliding_window_non_causal",),
    # Both the drafter's slot layout (spec) and what training applied (recipe): one declaration says both.
    "sample_from_anchor": ("sample_from_anchor",),
    "conv_kernel_size": ("conv_kernel_size",),
    "conv_group_size": ("conv_group_size",),
    "selector_rank": ("selector_rank",),
    "selector_top_k": ("selector_top_k",),
    "draft_vocab_size": ("draft_vocab_size",),
}
# Every name a recipe knob is declared under, from its declaration (impl/recipe.py).
RECIPE_NAMES = {name: tuple(info.json_schema_extra["names"]) for name, info in KNOBS.items()}
ALIASES = {alias: name for table in (SPEC_NAMES, RECIPE_NAMES) for name, aliases in table.items() for alias in aliases}
# Path components that scope a key to the target model rather than the drafter.
TARGET_SCOPES = {"target", "verifier", "target_config", "verifier_config", "target_model", "base_model", "teacher"}
TARGET_SCOPED = {"num_hidden_layers": "num_target_layers", "vocab_size": "target_vocab_size"}
# Keys that only speculators' TrainConfig has: its `target_layer_ids` are then its own (id + 1) convention.
SPECULATORS_MARKERS = {"speculator_type", "dflash_decay_gamma", "per_position_loss_weight", "dpace_alpha",
                       "loss_implementation", "ttt_steps", "speculators_model_type"}
SPECULATORS_IDS = "aux_hidden_state_layer_ids"
# Names common enough to mean something else (`loss` may be a loss value, `dim` any size):
# a value of the wrong type under one of them is listed as unrecognized, not refused.
GENERIC_ALIASES = {"loss", "loss_type", "dim", "mask_token", "layer_ids", "num_layers", "n_layers"}

# The value types: the spec's written here, the recipe knobs' from their declared types.
RECIPE_TYPES = {name: info.annotation for name, info in KNOBS.items() if not choices(name)}
INT_FIELDS = {"hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "num_hidden_layers", "target_vocab_size", "num_target_layers", "mask_token_id", "block_size",
              "max_position_embeddings", "sliding_window", "conv_kernel_size", "conv_group_size", "selector_rank",
              "selector_top_k", "draft_vocab_size"} | {n for n, t in RECIPE_TYPES.items() if t in (int, int | None)}
FLOAT_FIELDS = {"rope_theta", "partial_rotary_factor", "rms_norm_eps", "input_embedding_scale", "output_multiplier",
                "final_logit_softcapping"} | {n for n, t in RECIPE_TYPES.items() if t is float}
BOOL_FIELDS = {"attention_bias", "sliding_window_non_causal"} | {n for n, t in RECIPE_TYPES.items() if t is bool}
LOSS_SPELLINGS = {"ce": "ce", "cross_entropy": "ce", "crossentropy": "ce", "xent": "ce", "kl": "kl_div",
                  "kl_div": "kl_div", "kld": "kl_div", "forward_kl": "kl_div", "kl_divergence": "kl_div",
                  "tv": "tv", "total_variation": "tv"}


class DeclarationError(ValueError):
    """A declared value that cannot be what its name says (e.g. 'sixty-four' layers)."""


@dataclass
class Declaration:
    field: str
    value: Any
    where: str  # e.g. "ckpt.pt: args.gamma"


def flatten(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted path, leaf value) pairs; lists of scalars are leaves."""
    if isinstance(data, dict):
        pairs = []
        for key, value in data.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            pairs += flatten(value, path) if isinstance(value, dict) else [(path, value)]
        return pairs
    return [(prefix, data)]


def is_speculators_flavoured(data: dict[str, Any]) -> bool:
    return any(path.rsplit(".", 1)[-1] in SPECULATORS_MARKERS for path, _ in flatten(data))


def recognize(path: str) -> str | None:
    """The spec/recipe field a dotted key declares, or None."""
    parts = path.split(".")
    last = parts[-1]
    if any(p in TARGET_SCOPES for p in parts[:-1]):
        return TARGET_SCOPED.get(last)
    return ALIASES.get(last)


def convert(field: str, value: Any, where: str, speculators_ids: bool = False) -> Any:
    """The declared value as the field's type; DeclarationError naming `where` otherwise."""
    def fail(expected: str) -> DeclarationError:
        return DeclarationError(f"{where}: {value!r} is not {expected}")

    if field == "target_layer_ids":
        items = value.replace(",", " ").split() if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not items:
            raise fail("a list of layer ids")
        ids = [as_int(item, fail, "a list of integer layer ids") for item in items]
        if not speculators_ids:
            return ids
        try:
            return speculators_to_zlab(ids)
        except ValueError as exc:
            raise DeclarationError(f"{where}: {exc}") from exc
    if field == "layer_types":
        if not isinstance(value, (list, tuple)) or any(v not in LAYER_TYPES for v in value):
            raise fail(f"a list of {list(LAYER_TYPES)}")
        return list(value)
    if field == "per_position_loss_weight":
        spelled = str(value).strip().lower().replace("_", "-")
        if spelled not in LOSS_WEIGHTINGS:
            raise fail(f"a per_position_loss_weight ({list(LOSS_WEIGHTINGS)})")
        return spelled
    if field == "loss_fn":
        spelled = LOSS_SPELLINGS.get(str(value).strip().lower().replace("-", "_"))
        if spelled is not None:
            return spelled
        try:  # speculators' weighted combination, e.g. '{"ce": 0.1, "tv": 0.9}' (XPress's)
            return canonical_loss_fn(json.dumps(value) if isinstance(value, dict) else str(value))
        except ValueError:
            raise fail(f"a loss this tool knows ({sorted(LOSS_KINDS)}, or a JSON dict of them to weights)") from None
    if field == "hidden_act":
        if not isinstance(value, str):
            raise fail("an activation name")
        return value
    if field == "rope_style":
        if value not in ROPE_STYLES:
            raise fail(f"a rotary style ({list(ROPE_STYLES)})")
        return value
    if field == "rope_scaling":  # on the command line: JSON, e.g. {"rope_type": "linear", "factor": 2.0}, or none
        try:
            parsed = json.loads(value) if isinstance(value, str) else value
        except (json.JSONDecodeError, RecursionError):
            raise fail("a JSON object of transformers' rope parameters") from None
        if parsed is not None and not isinstance(parsed, dict):
            raise fail("a JSON object of transformers' rope parameters")
        return parsed
    if field in BOOL_FIELDS:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise fail("true or false")
    if field in INT_FIELDS:
        return None if value is None and field == "sliding_window" else as_int(value, fail, "an integer")
    if field in FLOAT_FIELDS:
        if value is None and field == "final_logit_softcapping":
            return None
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise fail("a number") from None
        if isinstance(value, bool) or not math.isfinite(number):
            raise fail("a finite number")
        return number
    raise fail("a known setting")  # pragma: no cover - every field is typed above


def as_int(value: Any, fail, expected: str) -> int:
    if isinstance(value, bool):
        raise fail(expected)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        try:
            return int(value.strip())
        except ValueError:  # digits int() does not read (superscripts)
            raise fail(expected) from None
    raise fail(expected)


def read_declarations(sources: list[tuple[str, dict[str, Any]]]):
    """Every recognized declaration (by field, first source first), every unrecognized key, and conflicts.

    `sources` are (label, plain dict) pairs, e.g. ("ckpt.pt: args", {...}).
    """
    declared: dict[str, list[Declaration]] = {}
    unrecognized: dict[str, Any] = {}
    for label, data in sources:
        speculators = is_speculators_flavoured(data)
        for path, value in flatten(data):
            field = recognize(path)
            where = (f"{label} {path}" if label.endswith(":") else f"{label}.{path}") if label else path
            if field is None or (value is None and field not in ("sliding_window", "final_logit_softcapping")):
                if not is_tensor_like(value):
                    unrecognized[where] = value if field is None else f"{value!r} (no value)"
                continue
            last = path.rsplit(".", 1)[-1]
            ids_in_speculators_convention = last == SPECULATORS_IDS or (speculators and last == "target_layer_ids")
            try:
                value = convert(field, value, where, ids_in_speculators_convention)
            except DeclarationError as exc:
                if last not in GENERIC_ALIASES:
                    raise
                unrecognized[where] = f"{value!r} (not read as {field}: {exc.args[0].split(': ', 1)[-1]})"
                continue
            note = " (speculators convention, id - 1)" if ids_in_speculators_convention else ""
            declared.setdefault(field, []).append(Declaration(field, value, where + note))
    return declared, unrecognized


def is_tensor_like(value: Any) -> bool:
    return type(value).__name__ in ("Tensor", "Parameter")
