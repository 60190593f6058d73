"""Static audit: two drafters' specs, recipes and draft-body tensors, compared without running them.

One root cause, one finding: a tensor whose shape differs because the configs differ is
listed in the tensor table as "explained by" that config finding, never again under
`weights`. Layer ids are compared normalized (z-lab convention), so the same drafter in
z-lab and speculators form gives no finding.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Any

import torch

from dflash_audit.audit.findings import Finding
from dflash_audit.audit.sides import Side
from dflash_audit.audit.stream_stats import is_finite, pair_stats_all
from impl.families import spec_family
from impl.model import DFlashDrafter
from impl.spec import DraftSpec, Recipe

# Architecture fields and the PITFALLS entry each maps to (None: no catalogue entry).
ARCHITECTURE_FIELDS = {
    "hidden_size": None, "intermediate_size": None, "num_attention_heads": None, "num_key_value_heads": None,
    "head_dim": None, "num_hidden_layers": None, "vocab_size": 13, "num_target_layers": 1, "rope_theta": 12,
    "rms_norm_eps": None, "max_position_embeddings": 12, "attention_bias": None, "hidden_act": None,
    "input_embedding_scale": 13, "output_multiplier": 13, "final_logit_softcapping": 13,
}
# Fields whose difference changes no output for contexts that fit both.
ARCHITECTURE_WARNINGS = {"max_position_embeddings"}

# recipe field -> (PITFALLS entry, severity, what a difference does)
RECIPE_FIELDS = {
    "gamma": (6, "divergence", "the loss decay weights later block positions differently, so the drafter "
              "learns a different trade-off between early and late tokens"),
    "loss_fn": (7, "divergence", "the drafter is fitted to a different objective"),
    "per_position_loss_weight": (6, "divergence", "block positions are weighted by a different rule (fixed "
                                 "exponential decay vs D-PACE's confidence-driven expected accepted length)"),
    "dpace_alpha": (6, "divergence", "D-PACE smooths the drafter's confidences differently, so later block "
                    "positions get a different share of the loss"),
    "verifier_source_layer": (3, "divergence", "the drafter is trained to predict the output of a different "
                              "target layer than the one the target decodes with"),
    "sample_from_anchor": (5, "divergence", "block slots are aligned to different target positions"),
    "noise_std": (15, "warning", "the context features were augmented differently during training"),
    "max_anchors": (8, "warning", "a different number of blocks per sequence was trained on"),
    "selector_loss_alpha": (24, "divergence", "the candidate selector's loss is weighted differently against the "
                            "unary loss, so the drafter trades its own proposals against the selector's reranking "
                            "differently"),
}
# DFlash2's own fields: the component each belongs to, its catalogue entry, and what a difference does.
DFLASH2_SPEC_FIELDS = {
    "conv_kernel_size": ("conv", 22, "each convolution mixes a different number of earlier block slots"),
    "conv_group_size": ("conv", 22, "the dynamic kernels are shared by different channel groups"),
    "selector_rank": ("selector", 23, "the selector's bilinear term has a different rank"),
    "selector_top_k": ("selector", 23, "the selector reranks a different number of unary candidates, so it can "
                       "propose tokens the other never considers (or not)"),
}


@dataclass
class SpecRow:
    name: str
    ours_raw: Any
    ref_raw: Any
    ours: Any
    ref: Any
    ours_source: dict[str, str] = field(default_factory=dict)  # provenance: {"source", "detail"}
    ref_source: dict[str, str] = field(default_factory=dict)

    @property
    def same(self) -> bool:
        return self.ours == self.ref


@dataclass
class TensorRow:
    key: str
    group: str  # "layers.0", "fc", "norm", ..., or "verifier-owned"
    # equal | values differ | missing in ours/ref | unexpected in ours/ref | shape | dtype | verifier-owned
    status: str
    ours_shape: list[int] | None = None
    ref_shape: list[int] | None = None
    ours_dtype: str | None = None
    ref_dtype: str | None = None
    max_abs_diff: float | None = None
    cosine: float | None = None
    explained_by: str = ""  # the config finding a shape/missing difference follows from
    non_finite: list[str] = field(default_factory=list)  # sides holding NaN/inf


@dataclass
class StaticAudit:
    findings: list[Finding]
    spec_rows: list[SpecRow]
    tensor_rows: list[TensorRow]
    recipes: dict[str, dict[str, Any]]  # side -> {"recipe": {...}, "source": "checkpoint" | reference}


def static_audit(ours: Side, ref: Side, expect_identical: bool = False, advance=lambda: None) -> StaticAudit:
    """All static findings of `ours` against `ref`. `advance` is called once per compared tensor."""
    findings = (self_findings(ours, "ours") + self_findings(ref, "ref") + shape_contradictions(ours, "ours")
                + shape_contradictions(ref, "ref") + spec_findings(ours, ref))
    recipe_found, recipes = recipe_findings(ours, ref)
    tensor_rows = compare_tensors(ours, ref, findings, advance)
    findings += recipe_found + weight_findings(tensor_rows, ours, ref, expect_identical)
    return StaticAudit(findings=findings, spec_rows=spec_rows(ours, ref), tensor_rows=tensor_rows, recipes=recipes)


# -- spec ------------------------------------------------------------------------------------
def spec_findings(ours: Side, ref: Side) -> list[Finding]:
    found = layer_id_findings(ours, ref)

    def both(name):
        return ours.is_known(name) and ref.is_known(name)

    o_block, r_block = ours.value("block_size"), ref.value("block_size")
    if both("block_size") and o_block != r_block:
        found.append(default_aware(ours, ref, "block_size", Finding(
            "block_size", "divergence",
            f"Blocks of {o_block} tokens in ours vs {r_block} in ref: a round drafts at most "
            f"{o_block - 1} vs {r_block - 1} tokens, and a drafter run with a block size it was not "
            "trained for mispredicts the extra slots.", o_block, r_block, pitfall=16)))
    o_mask, r_mask = ours.value("mask_token_id"), ref.value("mask_token_id")
    if both("mask_token_id") and o_mask != r_mask:
        found.append(default_aware(ours, ref, "mask_token_id", Finding(
            "mask_token", "divergence",
            f"The empty block slots are filled with token {o_mask} in ours but {r_mask} in ref: "
            "a drafter fed a mask token it never saw in training drafts garbage.", o_mask, r_mask, pitfall=14)))
    found += layer_type_findings(ours, ref) + window_direction_findings(ours, ref) + family_findings(ours, ref)
    for name, pitfall in ARCHITECTURE_FIELDS.items():
        a, b = ours.value(name), ref.value(name)
        if both(name) and a != b:
            severity = "warning" if name in ARCHITECTURE_WARNINGS else "divergence"
            found.append(default_aware(ours, ref, name, Finding(
                "architecture", severity, f"{name} is {a!r} in ours but {b!r} in ref: "
                + architecture_consequence(name), a, b, pitfall=pitfall, key=name)))
    return found


# Which finding component a spec field belongs to (for unknowns and contradictions).
FIELD_COMPONENT = {"target_layer_ids": "target_layers", "block_size": "block_size", "mask_token_id": "mask_token",
                   "layer_types": "layer_types", "sliding_window": "layer_types"}


def default_aware(ours: Side, ref: Side, name: str, finding: Finding) -> Finding:
    """A difference where one side only took a default is a warning: that side never said its value."""
    defaulted = [side for side, s in (("ours", ours), ("ref", ref)) if s.source(name) == "default"]
    if not defaulted or finding.severity != "divergence":
        return finding
    side = defaulted[0]
    flag = f"--{side}-spec {name}=..."
    finding.severity = "warning"
    finding.message += (f" ({side} does not declare {name}: its value is a default; if it was trained with another, "
                        f"give it with {flag})")
    return finding


def shape_contradictions(side: Side, name: str) -> list[Finding]:
    """A declared spec its own tensors disagree with (config says 3 target layers, fc.weight reads 2)."""
    expected = expected_shapes(side.spec) if side.spec is not None else {}
    wrong = [(key, tuple(t.shape), expected[key]) for key, t in side.state_dict.items()
             if key in expected and tuple(t.shape) != expected[key]]
    if not wrong:
        return []
    key, actual, implied = wrong[0]
    fc = key == "fc.weight" and len(actual) == 2 and side.spec.hidden_size and actual[1] % side.spec.hidden_size == 0
    if fc:
        detail = (f"its config names {len(side.spec.target_layer_ids)} target layers "
                  f"{list(side.spec.target_layer_ids)}, but fc.weight in_features {actual[1]} = "
                  f"{actual[1] // side.spec.hidden_size} layers of hidden {side.spec.hidden_size}")
    else:
        detail = f"its config implies {key} of shape {list(implied)}, the tensor is {list(actual)}"
    more = f" ({len(wrong)} tensors in all)" if len(wrong) > 1 else ""
    return [Finding("fc_dims" if fc else "architecture", "divergence", f"{name} contradicts itself: {detail}{more}.",
                    detail if name == "ours" else None, detail if name == "ref" else None,
                    pitfall=4 if fc else None, key=f"contradiction in {name}")]


def self_findings(side: Side, name: str) -> list[Finding]:
    """What one side says about itself: fields nobody can know without a declaration, contradictions."""
    found = []
    for field_name, prov in side.provenance.items():
        if prov.get("source") != "unknown" or field_name.startswith("recipe."):
            continue
        component = FIELD_COMPONENT.get(field_name, "architecture")
        found.append(Finding(component, "warning", f"{field_name} of {name} is unknown: {prov.get('detail', '')}.",
                             None if name == "ref" else "unknown", None if name == "ours" else "unknown",
                             key=f"unknown in {name}: {field_name}"))
    for text in side.contradictions:
        field_name = text.split(" ", 1)[0].rstrip(":")
        component = "fc_dims" if field_name == "target_layer_ids" else FIELD_COMPONENT.get(field_name, "architecture")
        found.append(Finding(component, "divergence", f"{name} contradicts itself: {text}.",
                             text if name == "ours" else None, text if name == "ref" else None,
                             key=f"contradiction in {name}: {field_name}"))
    return found


def architecture_consequence(name: str) -> str:
    if name == "num_target_layers":
        return "the two drafters were built for targets of different depth."
    if name == "num_hidden_layers":
        return "the drafters have a different number of decoder layers (their layer tensors differ accordingly)."
    if name == "max_position_embeddings":
        return "only contexts longer than the smaller limit behave differently."
    return "the two drafters compute different functions."


def layer_id_findings(ours: Side, ref: Side) -> list[Finding]:
    raw = {"ours": {"ids": ours.raw_layer_ids, "convention": ours.layer_id_convention},
           "ref": {"ids": ref.raw_layer_ids, "convention": ref.layer_id_convention}}
    ids_o, ids_r = ours.value("target_layer_ids"), ref.value("target_layer_ids")
    count_o, count_r = ours.fc_layer_count, ref.fc_layer_count
    if count_o is not None and count_r is not None and count_o != count_r:
        detail = []
        if ids_o is not None and ids_r is not None:
            left_out = [i for i in ids_r if i not in ids_o]
            extra = [i for i in ids_o if i not in ids_r]
            if left_out:
                deepest = " (the deepest)" if max(ids_r) in left_out else ""
                detail.append(f"ours leaves out target layer{'s' if len(left_out) > 1 else ''} "
                              f"{', '.join(map(str, left_out))}{deepest}")
            if extra:
                detail.append(f"ours adds {', '.join(map(str, extra))}")
        else:
            unknown = [side for side, ids in (("ours", ids_o), ("ref", ids_r)) if ids is None]
            detail.append(f"which layers {' and '.join(unknown)} read{'s' if len(unknown) == 1 else ''} is unknown")
        return [Finding(
            "fc_dims", "divergence",
            f"fc reads {count_o} target layers in ours but {count_r} in ref ({'; '.join(detail)}): "
            f"fc.weight in_features {ours.fc_in_features} vs {ref.fc_in_features}. Every selected layer must feed fc.",
            {"target_layer_ids": ids_o, "fc_in_features": ours.fc_in_features},
            {"target_layer_ids": ids_r, "fc_in_features": ref.fc_in_features}, pitfall=4, raw=raw)]
    if ids_o is not None and ids_r is not None and list(ids_o) != list(ids_r):
        ids_o, ids_r = list(ids_o), list(ids_r)
        shifted = all(a - b == ids_o[0] - ids_r[0] for a, b in zip(ids_o, ids_r)) and abs(ids_o[0] - ids_r[0]) == 1
        why = (" Every id is shifted by one: one side reads hs[id] where z-lab reads hs[id + 1]." if shifted
               else " The drafter reads different target layers than the reference was built with.")
        return [Finding("target_layers", "divergence",
                        f"Target layers {ids_o} in ours vs {ids_r} in ref (z-lab convention).{why}",
                        ids_o, ids_r, pitfall=2 if shifted else 1, raw=raw)]
    return []


def layer_type_findings(ours: Side, ref: Side) -> list[Finding]:
    o_layers, r_layers = ours.value("num_hidden_layers"), ref.value("num_hidden_layers")
    if o_layers != r_layers or not (ours.is_known("layer_types") and ref.is_known("layer_types")):
        return []  # a different layer count is the architecture finding's root cause
    o_types, r_types = list(ours.value("layer_types")), list(ref.value("layer_types"))
    found = []
    if o_types != r_types:
        differing = [i for i, (a, b) in enumerate(zip(o_types, r_types)) if a != b]
        found.append(default_aware(ours, ref, "layer_types", Finding(
            "layer_types", "divergence",
            f"Draft layer{'s' if len(differing) > 1 else ''} {differing} use a different attention type "
            "(sliding vs full): sliding layers are causal within the block and windowed over the context.",
            o_types, r_types, pitfall=11)))
    o_window, r_window = ours.value("sliding_window"), ref.value("sliding_window")
    if "sliding_attention" in o_types and o_window != r_window and o_types == r_types:
        found.append(default_aware(ours, ref, "sliding_window", Finding(
            "layer_types", "divergence",
            f"Sliding window {o_window} in ours vs {r_window} in ref: contexts longer than the "
            "smaller window are attended differently.", o_window, r_window, pitfall=11, key="sliding_window")))
    return found


def family_of(side: Side) -> str | None:
    """`dflash` or `dflash2` from the side's spec fields; None when its DFlash2 fields are unknown."""
    if side.spec is not None:
        return side.spec.family
    if side.is_known("conv_kernel_size"):
        return spec_family(side.value("conv_kernel_size"))
    return None


def describe_family(side: Side) -> str:
    if family_of(side) != "dflash2":
        return "DFlash (no convolutions, no selector)"
    value = side.value
    return (f"DFlash2 ({value('conv_kernel_size')}-tap convolutions in groups of {value('conv_group_size')} around "
            f"attention and MLP, a rank-{value('selector_rank')} selector reranking the top {value('selector_top_k')})")


def family_findings(ours: Side, ref: Side) -> list[Finding]:
    """DFlash vs DFlash2 is one architecture finding; between two DFlash2 drafters each differing
    convolution or selector setting is a `conv` or `selector` finding."""
    families = family_of(ours), family_of(ref)
    if None in families:
        return []
    if families[0] != families[1]:
        return [Finding("architecture", "divergence",
                        f"ours is {describe_family(ours)}, ref is {describe_family(ref)}: drafters of different "
                        "families compute different functions and propose tokens differently; their convolution "
                        "and selector tensors exist on one side only.", families[0], families[1], pitfall=19,
                        key="family")]
    if families[0] == "dflash":
        return []
    found = []
    for name, (component, pitfall, consequence) in DFLASH2_SPEC_FIELDS.items():
        a, b = ours.value(name), ref.value(name)
        if ours.is_known(name) and ref.is_known(name) and a != b:
            found.append(default_aware(ours, ref, name, Finding(
                component, "divergence", f"{name} is {a} in ours but {b} in ref: {consequence}.", a, b,
                pitfall=pitfall, key=name)))
    return found


def window_direction_findings(ours: Side, ref: Side) -> list[Finding]:
    """Bidirectional vs causal sliding blocks: a difference only where both have sliding layers."""
    name = "sliding_window_non_causal"
    if not all(side.is_known(name) and side.is_known("layer_types") and "sliding_attention" in side.value("layer_types")
               for side in (ours, ref)):
        return []
    a, b = ours.value(name), ref.value(name)
    if a == b:
        return []
    describe = {True: "see their whole block", False: "see only earlier block slots"}
    return [default_aware(ours, ref, name, Finding(
        "window_direction", "divergence",
        f"Sliding layers {describe[a]} in ours but {describe[b]} in ref (sliding_window_non_causal {a} vs {b}): "
        "every drafted slot after the first attends to a different part of its block.", a, b, pitfall=25,
        key=name))]


def spec_rows(ours: Side, ref: Side) -> list[SpecRow]:
    rows = [SpecRow("format", ours.format, ref.format, ours.format, ref.format),
            SpecRow("layer-id convention", ours.layer_id_convention, ref.layer_id_convention, "zlab", "zlab")]
    for f in fields(DraftSpec):
        a, b = (side.value(f.name) if side.is_known(f.name) else "unknown" for side in (ours, ref))
        a, b = (list(v) if isinstance(v, tuple) else v for v in (a, b))
        raw_a, raw_b = a, b
        if f.name == "target_layer_ids":  # as stored, in the format's own convention
            raw_a, raw_b = (side.raw_layer_ids if side.raw_layer_ids is not None else "unknown" for side in (ours, ref))
        rows.append(SpecRow(f.name, raw_a, raw_b, a, b, ours.provenance.get(f.name, {}), ref.provenance.get(f.name, {})))
    fc = [side.fc_in_features if side.fc_in_features is not None else "unknown" for side in (ours, ref)]
    rows.append(SpecRow("fc_in_features", fc[0], fc[1], fc[0], fc[1],
                        {"source": "inferred", "detail": "target layers x hidden size"},
                        {"source": "inferred", "detail": "target layers x hidden size"}))
    return rows


# -- recipe ----------------------------------------------------------------------------------
# Fields that only mean something under one weighting: compared only when both sides use it
# (under different weightings the one finding is per_position_loss_weight).
WEIGHTING_FIELDS = {"gamma": "fixed-exp-decay", "dpace_alpha": "dpace"}
DFLASH2_RECIPE_FIELDS = {"selector_loss_alpha"}  # compared only between two DFlash2 drafters


def recipe_of(side: Side, other: Side) -> tuple[Recipe, dict[str, str], bool, str]:
    """The side's recipe, per-field source, whether it carries one, and what it was held to.

    A side without a recipe is held to one of speculators' reference recipes, chosen by
    `speculators_recipe.yardstick_for` from the other side's recipe (D-PACE or CE there: the
    TrainConfig-resolved dflash recipe; else the model-level defaults). A foreign checkpoint's
    recipe is what it declared; the fields it did not declare are in `side.recipe_unknown` and
    are never compared (the placeholder values are not read)."""
    if side.recipe is not None or side.format == "foreign":
        return side.recipe or Recipe(), {}, True, ""
    from reference_adapters.speculators_recipe import yardstick_for

    reference, why = yardstick_for(other.recipe, set(other.recipe_unknown))
    return reference.recipe, reference.sources, False, f"held to {reference.title}: {why}"


def source_layer(recipe: Recipe, side: Side) -> int | str:
    if recipe.verifier_source_layer is not None:
        return recipe.verifier_source_layer
    depth = side.value("num_target_layers")
    return depth - 1 if depth is not None else "the final layer"


def is_final(layer: int | str, side: Side) -> bool:
    depth = side.value("num_target_layers")
    return layer == "the final layer" or (depth is not None and layer == depth - 1)


def recipe_findings(ours: Side, ref: Side) -> tuple[list[Finding], dict[str, dict[str, Any]]]:
    if ours.recipe is None and ref.recipe is None and "foreign" not in (ours.format, ref.format):
        note = "neither checkpoint carries a recipe"
        return [], {"ours": {"recipe": None, "source": note}, "ref": {"recipe": None, "source": note}}
    (ro, src_o, has_o, held_o), (rr, src_r, has_r, held_r) = recipe_of(ours, ref), recipe_of(ref, ours)
    unknown = set(ours.recipe_unknown) | set(ref.recipe_unknown)
    found = []
    for name, (pitfall, severity, consequence) in RECIPE_FIELDS.items():
        if name in unknown:
            continue  # a side that never said it: listed as unknown in the recipe table, not compared
        if name in DFLASH2_RECIPE_FIELDS and (family_of(ours), family_of(ref)) != ("dflash2", "dflash2"):
            continue  # a DFlash drafter has no selector to weight
        weighting = WEIGHTING_FIELDS.get(name)
        if weighting and any(weighting != r.per_position_loss_weight for r, side in ((ro, ours), (rr, ref))
                             if "per_position_loss_weight" not in side.recipe_unknown):
            continue  # unused by a side: no finding of its own (a declared value with no declared weighting counts)
        a, b = getattr(ro, name), getattr(rr, name)
        if name == "verifier_source_layer":
            a, b = source_layer(ro, ours), source_layer(rr, ref)
            if is_final(a, ours) and is_final(b, ref):
                continue  # both the final layer, even of targets of different depth
        if a == b:
            continue
        where = ""
        if not has_r:
            where = f" (ref carries no recipe, {held_r}; {src_r[name]})"
        elif not has_o:
            where = f" (ours carries no recipe, {held_o}; {src_o[name]})"
        found.append(Finding("recipe", severity, f"{name}: {a!r} in ours vs {b!r} in ref{where} — {consequence}.",
                             a, b, pitfall=pitfall, key=name))
    recipes = {side_name: recipe_table(side, recipe, sources, has, held)
               for side_name, side, recipe, sources, has, held in (("ours", ours, ro, src_o, has_o, held_o),
                                                                   ("ref", ref, rr, src_r, has_r, held_r))}
    return found, recipes


def recipe_table(side: Side, recipe: Recipe, sources: dict[str, str], has: bool, held: str = "") -> dict[str, Any]:
    values = recipe.to_dict()
    for name in side.recipe_unknown:
        values[name] = "unknown"
    if side.format == "foreign":
        sources = {name: side.provenance.get(f"recipe.{name}", {}).get("detail", "") for name in RECIPE_FIELDS}
        return {"recipe": values, "source": "declared by the checkpoint (unknown where not declared)",
                "sources": sources}
    return {"recipe": values, "source": "checkpoint" if has else f"reference defaults, {held}", "sources": sources}


# -- tensors ---------------------------------------------------------------------------------
@lru_cache(maxsize=8)  # asked per side by the contradiction check and the tensor table: built once
def expected_shapes(spec: DraftSpec | None) -> dict[str, tuple[int, ...]]:
    """Draft-body tensor shapes a spec implies (built on the meta device: no memory); {} if unknown.
    Callers only read the result."""
    if spec is None:
        return {}
    with torch.device("meta"):
        model = DFlashDrafter(spec)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def tensor_group(key: str) -> str:
    parts = key.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 1 else parts[0]


def shape_cause(key: str, findings: list[Finding]) -> str:
    components = {f.component for f in findings}
    if key.startswith("fc.") and "fc_dims" in components:
        return "fc_dims"
    if any(f.key == "family" for f in findings) and ("_conv." in key or key.startswith("candidate_selector.")):
        return "architecture"
    if "_conv." in key and "conv" in components:
        return "conv"
    if key.startswith("candidate_selector.") and "selector" in components:
        return "selector"
    return "architecture" if "architecture" in components else ""


def compare_tensors(ours: Side, ref: Side, findings: list[Finding], advance) -> list[TensorRow]:
    exp_o, exp_r = (expected_shapes(side.shape_spec()) for side in (ours, ref))
    rows = []
    keys = sorted(set(ours.state_dict) | set(ref.state_dict))
    comparable = {key: (ours.state_dict[key], ref.state_dict[key]) for key in keys if key in ours.state_dict
                  and key in ref.state_dict and tuple(ours.state_dict[key].shape) == tuple(ref.state_dict[key].shape)}
    all_stats = pair_stats_all(comparable)  # chunked float64: a tensor is never copied whole
    for key in keys:
        a, b = ours.state_dict.get(key), ref.state_dict.get(key)
        row = TensorRow(key, tensor_group(key), "equal",
                        ours_shape=list(a.shape) if a is not None else None,
                        ref_shape=list(b.shape) if b is not None else None,
                        ours_dtype=str(a.dtype).removeprefix("torch.") if a is not None else None,
                        ref_dtype=str(b.dtype).removeprefix("torch.") if b is not None else None)
        if a is None or b is None or tuple(a.shape) != tuple(b.shape):
            row.non_finite = [side for side, t in (("ours", a), ("ref", b)) if t is not None and not is_finite(t)]
        if a is None or b is None:
            row.status = "missing in ours" if a is None else "missing in ref"
            holder, lacker = (exp_r, exp_o) if a is None else (exp_o, exp_r)
            if key not in holder:
                row.status = "unexpected in ref" if a is None else "unexpected in ours"  # its own spec has no such tensor
            elif key not in lacker:
                row.explained_by = shape_cause(key, findings) or "architecture"
        elif tuple(a.shape) != tuple(b.shape):
            row.status = "shape"
            own = [name for name, t, exp in (("ours", a, exp_o), ("ref", b, exp_r)) if key in exp and
                   tuple(t.shape) != exp[key]]
            if own:  # a side's tensor disagrees with its own config: that contradiction is the cause
                row.explained_by = f"contradiction in {own[0]}"
            elif exp_o.get(key) != exp_r.get(key):
                row.explained_by = shape_cause(key, findings)
        else:
            if a.dtype != b.dtype:
                row.status = "dtype"
            stats = all_stats[key]
            row.max_abs_diff, row.cosine = stats.max_abs_diff, stats.cosine
            row.non_finite = [side for side, finite in (("ours", stats.finite_a), ("ref", stats.finite_b)) if not finite]
            if row.status == "equal" and stats.max_abs_diff != 0.0:
                row.status = "values differ"
        rows.append(row)
        advance()
    for side_name, side in (("ours", ours), ("ref", ref)):
        for key, t in sorted(side.verifier_tensors.items()):
            rows.append(TensorRow(key, "verifier-owned", "verifier-owned",
                                  **{f"{side_name}_shape": list(t.shape),
                                     f"{side_name}_dtype": str(t.dtype).removeprefix("torch.")}))
    return rows


def weight_findings(rows: list[TensorRow], ours: Side, ref: Side, expect_identical: bool) -> list[Finding]:
    found = []
    body = [r for r in rows if r.group != "verifier-owned"]

    def keys(pred):
        return [r.key for r in body if pred(r)]

    for side in ("ours", "ref"):
        missing = keys(lambda r: r.status == f"missing in {side}" and not r.explained_by)
        if missing:
            other = "ref" if side == "ours" else "ours"
            found.append(Finding(
                "weights", "divergence",
                f"{len(missing)} draft-body tensor(s) that {side}'s own config requires are absent from {side} "
                f"but present in {other} (first: {missing[0]}); the drafter cannot be built as described.",
                missing if side == "ours" else None, missing if side == "ref" else None, key=f"missing in {side}"))
        bad = keys(lambda r: side in r.non_finite)
        if bad:
            found.append(Finding(
                "weights", "divergence",
                f"{len(bad)} tensor(s) of {side} hold NaN or infinite values (first: {bad[0]}): every draft from "
                "it is garbage.", bad if side == "ours" else None, bad if side == "ref" else None,
                key=f"non-finite in {side}"))
    found += unexpected_findings(body, ours, ref)
    shape = keys(lambda r: r.status == "shape" and not r.explained_by)
    if shape:
        found.append(Finding("weights", "divergence",
                             f"{len(shape)} tensor(s) differ in shape although the configs agree (first: {shape[0]}).",
                             shape, shape, key="shape"))
    dtype = [r for r in body if r.status == "dtype"]
    if dtype:
        found.append(Finding(
            "weights", "divergence" if expect_identical else "warning",
            f"{len(dtype)} tensor(s) are stored in a different dtype (first: {dtype[0].key}, "
            f"{dtype[0].ours_dtype} vs {dtype[0].ref_dtype}): outputs differ by rounding.",
            dtype[0].ours_dtype, dtype[0].ref_dtype, key="dtype"))
    compared = [r for r in body if r.max_abs_diff is not None]
    differing = [r for r in compared if r.max_abs_diff]
    if differing:
        worst = max(differing, key=lambda r: r.max_abs_diff)
        least = min(differing, key=lambda r: r.cosine)
        expected = ("--expect-identical was given, so any difference is a divergence" if expect_identical
                    else "expected between independently trained drafters")
        found.append(Finding(
            "weights", "divergence" if expect_identical else "info",
            f"{len(differing)} of {len(compared)} comparable draft-body tensors differ in value (largest |Δ| "
            f"{worst.max_abs_diff:.3g} in {worst.key}; lowest cosine {least.cosine:.4f} in {least.key}): {expected}.",
            {"max_abs_diff": worst.max_abs_diff, "tensor": worst.key},
            {"min_cosine": least.cosine, "tensor": least.key}, key="values"))
    found += ignored_entry_findings(ours, ref)
    owned = {side: sorted(s.verifier_tensors) for side, s in (("ours", ours), ("ref", ref)) if s.verifier_tensors}
    if owned:
        found.append(Finding(
            "weights", "info",
            "Verifier-owned tensors (" + "; ".join(f"{side}: {', '.join(k)}" for side, k in owned.items())
            + ") are copies of the target's embeddings, head and norm, not trained draft weights; not compared.",
            owned.get("ours"), owned.get("ref"), pitfall=13, key="verifier-owned"))
    return found


# Tensor-name tokens of drafter families other than DFlash (an extra tensor of one names the family).
FAMILY_TOKENS = {"DFlash2 (grouped causal convolutions, candidate selector)": ("conv", "selector", "codebook")}


def unexpected_findings(rows: list[TensorRow], ours: Side, ref: Side) -> list[Finding]:
    """Tensors a side holds that no DFlash drafter of its own spec has: never dropped, always a finding."""
    found = []
    for side_name, side in (("ours", ours), ("ref", ref)):
        extra = [r.key for r in rows if r.status == f"unexpected in {side_name}"]
        if not extra:
            continue
        mapped_to_nothing = side.foreign.get("key_map", {}).get("unmapped", [])
        family = next((name for name, tokens in FAMILY_TOKENS.items()
                       if any(t in key for key in extra for t in tokens)), None)
        values = (extra if side_name == "ours" else None, extra if side_name == "ref" else None)
        if family:
            found.append(Finding(
                "architecture", "divergence",
                f"{side_name} holds {len(extra)} tensor(s) of the {family} family (first: {extra[0]}) that a DFlash "
                "drafter does not have: the two drafters are of different families.", *values,
                key=f"family of {side_name}"))
            continue
        why = (" (the key map sends them to no canonical name)" if mapped_to_nothing else "")
        found.append(Finding(
            "weights", "divergence",
            f"{len(extra)} tensor(s) in {side_name} that a DFlash drafter of its spec does not have (first: "
            f"{extra[0]}){why}: listed in the tensor table, compared with nothing.", *values,
            key=f"unexpected in {side_name}"))
    return found


def ignored_entry_findings(ours: Side, ref: Side) -> list[Finding]:
    """Training state found beside the weights (optimizer, scheduler, ...): named, not audited."""
    found = []
    for side_name, side in (("ours", ours), ("ref", ref)):
        ignored = side.foreign.get("ignored_entries") or {}
        if ignored:
            listing = ", ".join(f"{key} ({role})" for key, role in ignored.items())
            entry = side.foreign.get("entry")
            used = f"the drafter's weights were read from entry {entry!r}; " if entry else ""
            found.append(Finding("weights", "info", f"{side_name}: {used}also in the file, not audited: {listing}.",
                                 ignored if side_name == "ours" else None, ignored if side_name == "ref" else None,
                                 key=f"ignored entries of {side_name}"))
    return found
