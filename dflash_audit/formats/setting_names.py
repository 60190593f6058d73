"""The names under which checkpoints, configs and training args declare a drafter's settings.

One table maps every recognized name (z-lab's, speculators' `TrainConfig` and model config,
and the common ones teams use) to a `DraftSpec` or `Recipe` field, built from the fields' declarations
(`names` in impl/spec.py and impl/recipe.py). Declared dicts are
walked recursively; a key is recognized by its last path component, so `args.gamma`,
`train.loss.gamma` and `dflash_config.block_size` all count. Keys under a target/verifier
scope describe the target (`target.num_hidden_layers` is the target's depth). Whatever is
not recognized is kept verbatim for the report.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AllowInfNan, BeforeValidator, Field, Strict, TypeAdapter, ValidationError

from impl.layers import speculators_to_zlab
from impl.recipe import KNOBS, LOSS_KINDS, LOSS_WEIGHTINGS, LossWeighting, canonical_loss_fn, choices
from impl.settings import base_type
from impl.spec import LAYER_TYPES, ROPE_STYLES, SETTINGS, SPEC_NAMES

# Every name a spec setting (impl/spec.py) or a recipe knob (impl/recipe.py) is declared under.
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
LOSS_SPELLINGS = {"ce": "ce", "cross_entropy": "ce", "crossentropy": "ce", "xent": "ce", "kl": "kl_div",
                  "kl_div": "kl_div", "kld": "kl_div", "forward_kl": "kl_div", "kl_divergence": "kl_div",
                  "tv": "tv", "total_variation": "tv"}

# -- what each setting's declared value is read as: pydantic types, one per field ----------------------------------
# Values come from JSON configs, training args and `KEY=VALUE` text, so each type also reads its text form ("7",
# "true", "1,16,31", a JSON object), and nothing looser: `1` is no boolean, 7.5 no layer count, inf no gamma.
def _integer_text(value: Any) -> Any:
    if isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]+\s*", value):
        return int(value)
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _number_text(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _bool_text(value: Any) -> Any:
    return value.lower() == "true" if isinstance(value, str) and value.lower() in ("true", "false") else value


def _items_text(value: Any) -> Any:
    return value.replace(",", " ").split() if isinstance(value, str) else value


def _weighting_spelling(value: Any) -> Any:
    return str(value).strip().lower().replace("_", "-")


def _loss_spelling(value: Any) -> str:
    spelled = LOSS_SPELLINGS.get(str(value).strip().lower().replace("-", "_"))
    # else speculators' weighted combination, e.g. '{"ce": 0.1, "tv": 0.9}' (XPress's); its ValueError refuses it
    return spelled or canonical_loss_fn(json.dumps(value) if isinstance(value, dict) else str(value))


def _json_text(value: Any) -> Any:
    try:
        return json.loads(value) if isinstance(value, str) else value
    except RecursionError:
        raise ValueError("nested too deep") from None
    except json.JSONDecodeError:
        return value


Integer = Annotated[int, BeforeValidator(_integer_text), Strict()]
Number = Annotated[float, BeforeValidator(_number_text), Strict(), AllowInfNan(False)]
Boolean = Annotated[bool, BeforeValidator(_bool_text), Strict()]
LayerIds = Annotated[list[Integer], BeforeValidator(_items_text), Field(min_length=1)]
# Each setting read by name with a type of its own, and the words a refusal says it is not.
SPECIAL = {
    "target_layer_ids": (LayerIds, "a list of integer layer ids"),
    "layer_types": (list[Literal[LAYER_TYPES]], f"a list of {list(LAYER_TYPES)}"),
    "per_position_loss_weight": (Annotated[LossWeighting, BeforeValidator(_weighting_spelling)],
                                 f"a per_position_loss_weight ({list(LOSS_WEIGHTINGS)})"),
    "loss_fn": (Annotated[str, BeforeValidator(_loss_spelling)],
                f"a loss this tool knows ({sorted(LOSS_KINDS)}, or a JSON dict of them to weights)"),
    "hidden_act": (Annotated[str, Strict()], "an activation name"),
    "rope_style": (Literal[ROPE_STYLES], f"a rotary style ({list(ROPE_STYLES)})"),
    # on the command line: JSON, e.g. {"rope_type": "linear", "factor": 2.0}, or none
    "rope_scaling": (Annotated[dict[str, Any] | None, BeforeValidator(_json_text)],
                     "a JSON object of transformers' rope parameters"),
    "sliding_window": (Integer | None, "an integer"),
    "final_logit_softcapping": (Number | None, "a finite number"),
}
# The value types, from the declarations (impl/spec.py, impl/recipe.py) of the settings read by name.
RECIPE_TYPES = {name: info.annotation for name, info in KNOBS.items() if not choices(name)}
SPEC_TYPES = {name: base_type(SETTINGS[name]) for name in SPEC_NAMES}
INT_FIELDS = ({n for n, t in SPEC_TYPES.items() if t is int}
              | {n for n, t in RECIPE_TYPES.items() if t in (int, int | None)})
FLOAT_FIELDS = {n for n, t in SPEC_TYPES.items() if t is float} | {n for n, t in RECIPE_TYPES.items() if t is float}
BOOL_FIELDS = {n for n, t in SPEC_TYPES.items() if t is bool} | {n for n, t in RECIPE_TYPES.items() if t is bool}
READ_AS = {**{n: (Integer, "an integer") for n in INT_FIELDS}, **{n: (Number, "a finite number") for n in FLOAT_FIELDS},
           **{n: (Boolean, "true or false") for n in BOOL_FIELDS}, **SPECIAL}
READERS = {name: (TypeAdapter(kind), words) for name, (kind, words) in READ_AS.items()}


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
    """The declared value as the field's type (pydantic reads it by `READERS`); DeclarationError naming `where`
    otherwise. Speculators' layer ids (hidden-state index, id + 1) are given in z-lab's convention."""
    reader, words = READERS[field]
    try:
        read = reader.validate_python(value)
    except ValidationError:
        shown = repr(value) if len(repr(value)) <= 120 else repr(value)[:117] + "..."  # a hostile value stays one line
        raise DeclarationError(f"{where}: {shown} is not {words}") from None
    if field == "target_layer_ids" and speculators_ids:
        try:
            return speculators_to_zlab(read)
        except ValueError as exc:
            raise DeclarationError(f"{where}: {exc}") from exc
    return read


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
