"""A drafter's spec and recipe from what a foreign checkpoint shows and says, with provenance.

Sources, strongest first: the command line (`--ours-spec KEY=VALUE`), the tensors' shapes
(hidden size, draft layers, heads, head_dim, intermediate size, how many target layers fc
reads, vocabulary where embeddings or a head are present), what the checkpoint or the files
beside it declare, the target's config (`--target`), and Qwen3's defaults for the settings a
Qwen3 layer always has. Which target layers feed fc, the mask token, the block size and the
target's depth cannot be read from weights: without a declaration they stay unknown, never
guessed. A declaration that the weights contradict is kept as a contradiction of that
checkpoint, and the field then follows the weights (shape fields) or stays unknown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_audit.formats.setting_names import (
    ALIASES,
    Declaration,
    DeclarationError,
    convert,
    read_declarations,
)
from impl.defaults import QWEN3_DEFAULTS, ROTARY_DEFAULTS, ZLAB_EXTRAS
from impl.families import DFLASH2_MARKERS, HEAD_PREFIXES, TITLES, body_is_dflash2, head_family, spec_family
from impl.recipe import RECIPE_FIELDS, Recipe
from impl.spec import DSPARK_FIELDS, SPEC_FIELDS, XPRESS_FIELDS, DraftSpec, SpecError

# What a config that omits a Qwen3 layer setting, a rotary setting or a z-lab extra gets.
CONFIG_DEFAULTS = {**QWEN3_DEFAULTS, **ROTARY_DEFAULTS, **ZLAB_EXTRAS}
LAYER_KEY = re.compile(r"^layers\.(\d+)\.")


@dataclass
class Provenance:
    source: str  # declared | inferred | cli | default | unknown
    detail: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"source": self.source, "detail": self.detail}


@dataclass(frozen=True)
class Contradiction:
    """A checkpoint disagreeing with itself: the spec field it concerns and, in words, what says what."""

    spec_field: str
    text: str

    def __str__(self) -> str:
        return self.text


@dataclass
class Inference:
    values: dict[str, Any]  # known spec fields
    provenance: dict[str, Provenance]  # every spec field and every recipe field
    recipe_values: dict[str, Any]
    contradictions: list[Contradiction] = field(default_factory=list)
    unrecognized: dict[str, Any] = field(default_factory=dict)
    fc_layer_count: int | None = None

    @property
    def missing(self) -> list[str]:
        return [name for name in SPEC_FIELDS if name not in self.values]

    def spec(self, source: str) -> DraftSpec | None:
        if self.missing:
            return None
        values = dict(self.values)
        values["layer_types"] = tuple(values["layer_types"] or ())
        try:
            return DraftSpec(**values)
        except SpecError as exc:
            raise DeclarationError(f"{source}: {exc} ({self.provenance[exc.field].detail})"
                                   if exc.field in self.provenance else f"{source}: {exc}") from exc

    def recipe(self) -> Recipe | None:
        return Recipe(**self.recipe_values) if self.recipe_values else None

    @property
    def recipe_unknown(self) -> list[str]:
        return [name for name in RECIPE_FIELDS if name not in self.recipe_values]


# -- shapes ----------------------------------------------------------------------------------
def shape_facts(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[Any, str]]:
    """What the canonical tensors' shapes say: field -> (value, how it was read)."""
    facts: dict[str, tuple[Any, str]] = {}

    def shape(name):
        return tuple(shapes[name]) if name in shapes else None

    for name in ("norm.weight", "hidden_norm.weight", "layers.0.input_layernorm.weight"):
        if shape(name) and len(shape(name)) == 1:
            facts["hidden_size"] = (shape(name)[0], f"{name} shape {list(shape(name))}")
            break
    else:
        if shape("fc.weight") and len(shape("fc.weight")) == 2:
            facts["hidden_size"] = (shape("fc.weight")[0], f"fc.weight shape {list(shape('fc.weight'))} (out features)")
    layers = sorted({int(m.group(1)) for key in shapes if (m := LAYER_KEY.match(key))})
    if layers:
        facts["num_hidden_layers"] = (len(layers), f"layers.{layers[0]}..layers.{layers[-1]} ({len(layers)} indices)")
    q_norm, q_proj = shape("layers.0.self_attn.q_norm.weight"), shape("layers.0.self_attn.q_proj.weight")
    k_proj, gate = shape("layers.0.self_attn.k_proj.weight"), shape("layers.0.mlp.gate_proj.weight")
    if q_norm:
        head_dim = q_norm[0]
        facts["head_dim"] = (head_dim, f"layers.0.self_attn.q_norm.weight shape {list(q_norm)}")
        # A zero-sized q_norm shows head_dim 0 (the spec refuses it); nothing is divided by it.
        if head_dim and q_proj and q_proj[0] % head_dim == 0:
            facts["num_attention_heads"] = (q_proj[0] // head_dim,
                                            f"layers.0.self_attn.q_proj.weight rows {q_proj[0]} / head_dim {head_dim}")
        if head_dim and k_proj and k_proj[0] % head_dim == 0:
            facts["num_key_value_heads"] = (k_proj[0] // head_dim,
                                            f"layers.0.self_attn.k_proj.weight rows {k_proj[0]} / head_dim {head_dim}")
    if gate:
        facts["intermediate_size"] = (gate[0], f"layers.0.mlp.gate_proj.weight shape {list(gate)}")
    if layers:
        facts["attention_bias"] = ("layers.0.self_attn.q_proj.bias" in shapes,
                                   "layers.0.self_attn.q_proj.bias " +
                                   ("present" if "layers.0.self_attn.q_proj.bias" in shapes else "absent"))
    draft = shape("d2t")
    facts["draft_vocab_size"] = ((draft[0], f"d2t shape {list(draft)}") if draft and len(draft) == 1
                                 else (None, "no d2t tensor: the head covers the target's vocabulary"))
    for name in ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"):
        if name == "lm_head.weight" and draft:
            continue  # a reduced draft vocabulary's own head: its rows are the draft vocabulary, not the target's
        if shape(name) and len(shape(name)) == 2:
            facts["target_vocab_size"] = (shape(name)[0], f"{name} shape {list(shape(name))}")
            break
    facts.update(dflash2_facts(shapes, facts.get("hidden_size", (None,))[0]))
    facts.update(absent_head_facts(shapes))
    return facts


def absent_head_facts(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[Any, str]]:
    """A body without a family's head tensors is not of that family: its head settings are none, as read from
    the weights (a body with them keeps its settings to be declared)."""
    heads = {head_family(name) for name in shapes} - {None}
    return {name: (None, f"no {TITLES[family]} head tensors ({', '.join(HEAD_PREFIXES[family])}): "
                         f"not a {TITLES[family]} drafter")
            for family, names in (("dspark", DSPARK_FIELDS), ("xpress", XPRESS_FIELDS)) if family not in heads
            for name in names}


def dflash2_facts(shapes: dict[str, tuple[int, ...]], hidden: int | None) -> dict[str, tuple[Any, str]]:
    """The convolution and selector sizes a DFlash2 body's shapes show (its top-k shows in none); a body
    with neither is a DFlash one."""
    if not body_is_dflash2(shapes):
        return {name: (None, "no convolution or selector tensors: a DFlash drafter")
                for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
    facts: dict[str, tuple[Any, str]] = {}
    base, projection = shapes.get(DFLASH2_MARKERS[0]), shapes.get("layers.0.attention_conv.kernel_projection.weight")
    if base and len(base) == 3:
        taps = base[1]
        facts["conv_kernel_size"] = (taps, f"{DFLASH2_MARKERS[0]} shape {list(base)}")
        # Zero taps or a zero-row projection show no group size (nothing is divided by zero).
        if (taps and projection and projection[0] and hidden and projection[0] % (2 * taps) == 0
                and hidden % (projection[0] // (2 * taps)) == 0):
            groups = projection[0] // (2 * taps)
            facts["conv_group_size"] = (hidden // groups, f"hidden {hidden} / ({projection[0]} kernel_projection rows"
                                                          f" / 2 sides / {taps} taps)")
    codebook = shapes.get(DFLASH2_MARKERS[1])
    if codebook and len(codebook) == 2:
        facts["selector_rank"] = (codebook[1], f"{DFLASH2_MARKERS[1]} shape {list(codebook)}")
    return facts


def fc_layer_count(shapes: dict[str, tuple[int, ...]], hidden: int | None) -> tuple[int, str] | None:
    fc = shapes.get("fc.weight")
    if fc is None or len(fc) != 2 or not hidden or fc[1] % hidden:
        return None
    return fc[1] // hidden, f"fc.weight in_features {fc[1]} / hidden {hidden}"


# -- putting it together -------------------------------------------------------------------------
def parse_cli_spec(pairs: list[str], flag: str) -> dict[str, tuple[Any, str]]:
    """`--ours-spec KEY=VALUE` pairs -> field -> (value, detail); lists are comma-separated."""
    parsed = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise DeclarationError(f"{flag} {pair!r}: expected KEY=VALUE")
        name = ALIASES.get(key, key)
        if name not in SPEC_FIELDS and name not in RECIPE_FIELDS:
            raise DeclarationError(f"{flag} {key}: not a spec or recipe field (spec: {', '.join(SPEC_FIELDS)}; "
                                   f"recipe: {', '.join(sorted(RECIPE_FIELDS))})")
        raw = raw.strip()
        value: Any = raw
        if name == "layer_types":
            value = [v.strip() for v in raw.split(",") if v.strip()]
        elif raw.lower() in ("none", "null") and name in ("sliding_window", "final_logit_softcapping",
                                                           "verifier_source_layer", "rope_scaling"):
            value = None
        if value is not None:
            value = convert(name, value, f"{flag} {key}")
        parsed[name] = (value, f"{flag} {key}={raw}")
    return parsed


def declared_rope_dict(unrecognized: dict[str, Any]) -> tuple[dict[str, Any] | None, str] | None:
    """A rope dict a checkpoint declares (`rope_scaling.type`, `rope_parameters.rope_type` and their keys), read as
    transformers reads it: (the scaling, None for the default rope; where). None when none is declared."""
    from impl.rotary_config import rotary_settings

    for where, value in unrecognized.items():
        prefix, _, last = where.rpartition(".")
        if re.split(r"[.\s]", prefix)[-1] in ("rope_scaling", "rope_parameters") and last in ("rope_type", "type"):
            rope = {key[len(prefix) + 1:]: item for key, item in unrecognized.items()
                    if key.startswith(prefix + ".") and "." not in key[len(prefix) + 1:]}
            try:
                return rotary_settings({"rope_parameters": rope})["rope_scaling"], prefix
            except (SpecError, TypeError, ValueError):
                return None  # not a rope dict transformers reads: left to the default rules (listed unrecognized)
    return None


def infer(shapes: dict[str, tuple[int, ...]], declaration_sources: list[tuple[str, dict[str, Any]]],
          target_config: dict[str, Any] | None, target_label: str, cli: dict[str, tuple[Any, str]],
          cli_flag: str) -> Inference:
    declared, unrecognized = read_declarations(declaration_sources)
    facts = shape_facts(shapes)
    values: dict[str, Any] = {}
    provenance: dict[str, Provenance] = {}
    contradictions: list[Contradiction] = []

    def settle(name: str, candidates: list[Declaration]) -> Declaration | None:
        """The one declared value; two sources that disagree are a contradiction of this checkpoint."""
        distinct = {repr(d.value) for d in candidates}
        if len(distinct) > 1:
            contradictions.append(Contradiction(name, f"{name} is declared as " + " and as ".join(
                f"{d.value!r} ({d.where})" for d in candidates)))
            return None
        return candidates[0] if candidates else None

    for name in SPEC_FIELDS:
        if name in cli:
            values[name], provenance[name] = cli[name][0], Provenance("cli", cli[name][1])
            continue
        said = settle(name, declared.get(name, []))
        if name in facts:
            value, how = facts[name]
            if said is not None and said.value != value:
                contradictions.append(Contradiction(name, f"{name}: {said.where} declares {said.value!r}, but {how} "
                                                          f"says {value!r}"))
            values[name], provenance[name] = value, Provenance("inferred", how)
        elif said is not None:
            values[name], provenance[name] = said.value, Provenance("declared", said.where)
        elif name == "rope_scaling" and (rope := declared_rope_dict(unrecognized)) is not None:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            scaling, where = rope
            if scaling is None or scaling.get("rope_type") in ROPE_INIT_FUNCTIONS:
                values[name], provenance[name] = scaling, Provenance("declared", where)
        elif target_config is not None and name in ("num_target_layers", "target_vocab_size"):
            key = "num_hidden_layers" if name == "num_target_layers" else "vocab_size"
            if isinstance(target_config.get(key), int):
                values[name] = target_config[key]
                provenance[name] = Provenance("inferred", f"{target_label} {key}")
        elif name in CONFIG_DEFAULTS:
            values[name] = CONFIG_DEFAULTS[name]
            provenance[name] = Provenance("default", "not declared; Qwen3 / z-lab default")
    # Layer types and window: all full attention unless declared (a Qwen3 config's default).
    if "layer_types" not in values and "num_hidden_layers" in values:
        window = values.get("sliding_window")
        kind = "sliding_attention" if window else "full_attention"
        values["layer_types"] = [kind] * values["num_hidden_layers"]
        provenance["layer_types"] = Provenance("default", f"not declared; every layer {kind} (Qwen3 default)")
    if "sliding_window" not in values:
        values["sliding_window"] = None
        provenance["sliding_window"] = Provenance("default", "not declared; no sliding window (Qwen3 default)")
    if "sliding_window_non_causal" not in values:
        # Both references' DFlash default is causal; for DFlash2 they differ (speculators bidirectional,
        # z-lab causal unless `is_causal: false`), so there it stays unknown where it matters.
        sliding = "sliding_attention" in (values.get("layer_types") or [])
        if not sliding or ("conv_kernel_size" in values and spec_family(values["conv_kernel_size"]) == "dflash"):
            values["sliding_window_non_causal"] = False
            provenance["sliding_window_non_causal"] = Provenance(
                "default", "not declared; no sliding layers" if not sliding else
                "not declared; sliding blocks causal (both references' DFlash default)")
    if "sample_from_anchor" not in values:
        values["sample_from_anchor"] = False
        provenance["sample_from_anchor"] = Provenance(
            "default", "not declared; the anchor is the bonus token (both references' DFlash default)")

    count = fc_layer_count(shapes, values.get("hidden_size"))
    ids = values.get("target_layer_ids")
    if count and ids is not None and len(ids) != count[0]:
        contradictions.append(Contradiction("target_layer_ids", f"target_layer_ids: "
                                            f"{provenance['target_layer_ids'].detail} names {len(ids)} layers "
                                            f"{list(ids)}, but {count[1]} = {count[0]} layers"))
        del values["target_layer_ids"]
    for name in SPEC_FIELDS:
        if name not in values:
            flag_hint = f"{cli_flag} {name}=..." + (" or --target" if name in ("num_target_layers", "target_vocab_size")
                                                      else "")
            why = ("which target layers feed fc cannot be read from weights" if name == "target_layer_ids"
                   else "not declared and not visible in the weights")
            provenance[name] = Provenance("unknown", f"{why}; give it with {flag_hint}")

    recipe_values: dict[str, Any] = {}
    for name in sorted(RECIPE_FIELDS):
        if name in cli:
            recipe_values[name], provenance[f"recipe.{name}"] = cli[name][0], Provenance("cli", cli[name][1])
            continue
        said = settle(name, declared.get(name, []))
        if said is not None:
            recipe_values[name] = said.value
            provenance[f"recipe.{name}"] = Provenance("declared", said.where)
        else:
            provenance[f"recipe.{name}"] = Provenance("unknown", f"not declared; give it with {cli_flag} {name}=...")
    return Inference(values, provenance, recipe_values, contradictions, unrecognized,
                     count[0] if count else None)


def shapes_of(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in tensors.items()}
