"""Static audit: two drafters' specs, recipes and draft-body tensors, compared without running them.

One root cause, one finding: a tensor whose shape differs because the configs differ is
listed in the tensor table as "explained by" that config finding, never again under
`weights`. Layer ids are compared normalized (z-lab convention), so the same drafter in
z-lab and speculators form gives no finding.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from dflash_audit.audit.findings import Finding
from dflash_audit.audit.sides import Side
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
    "loss_kind": (7, "divergence", "the drafter is fitted to a different objective"),
    "verifier_source_layer": (3, "divergence", "the drafter is trained to predict the output of a different "
                              "target layer than the one the target decodes with"),
    "sample_from_anchor": (5, "divergence", "block slots are aligned to different target positions"),
    "noise_std": (15, "warning", "the context features were augmented differently during training"),
    "max_anchors": (8, "warning", "a different number of blocks per sequence was trained on"),
}


@dataclass
class SpecRow:
    name: str
    ours_raw: Any
    ref_raw: Any
    ours: Any
    ref: Any

    @property
    def same(self) -> bool:
        return self.ours == self.ref


@dataclass
class TensorRow:
    key: str
    group: str  # "layers.0", "fc", "norm", ..., or "verifier-owned"
    status: str  # equal | values differ | missing in ours | missing in ref | shape | dtype | verifier-owned
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
    findings = spec_findings(ours, ref)
    recipe_found, recipes = recipe_findings(ours, ref)
    tensor_rows = compare_tensors(ours, ref, findings, advance)
    findings += recipe_found + weight_findings(tensor_rows, ours, ref, expect_identical)
    return StaticAudit(findings=findings, spec_rows=spec_rows(ours, ref), tensor_rows=tensor_rows, recipes=recipes)


# -- spec ------------------------------------------------------------------------------------
def spec_findings(ours: Side, ref: Side) -> list[Finding]:
    o, r = ours.spec, ref.spec
    found = layer_id_findings(ours, ref)
    if o.block_size != r.block_size:
        found.append(Finding(
            "block_size", "divergence",
            f"Blocks of {o.block_size} tokens in ours vs {r.block_size} in ref: a round drafts at most "
            f"{o.block_size - 1} vs {r.block_size - 1} tokens, and a drafter run with a block size it was not "
            "trained for mispredicts the extra slots.", o.block_size, r.block_size, pitfall=16))
    if o.mask_token_id != r.mask_token_id:
        found.append(Finding(
            "mask_token", "divergence",
            f"The empty block slots are filled with token {o.mask_token_id} in ours but {r.mask_token_id} in ref: "
            "a drafter fed a mask token it never saw in training drafts garbage.",
            o.mask_token_id, r.mask_token_id, pitfall=14))
    found += layer_type_findings(o, r)
    for name, pitfall in ARCHITECTURE_FIELDS.items():
        a, b = getattr(o, name), getattr(r, name)
        if a != b:
            severity = "warning" if name in ARCHITECTURE_WARNINGS else "divergence"
            found.append(Finding(
                "architecture", severity, f"{name} is {a!r} in ours but {b!r} in ref: "
                + architecture_consequence(name), a, b, pitfall=pitfall, key=name))
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
    o, r = ours.spec, ref.spec
    raw = {"ours": {"ids": ours.raw_layer_ids, "convention": ours.layer_id_convention},
           "ref": {"ids": ref.raw_layer_ids, "convention": ref.layer_id_convention}}
    ids_o, ids_r = list(o.target_layer_ids), list(r.target_layer_ids)
    if len(ids_o) != len(ids_r):
        left_out = [i for i in ids_r if i not in ids_o]
        extra = [i for i in ids_o if i not in ids_r]
        detail = []
        if left_out:
            deepest = " (the deepest)" if max(ids_r) in left_out else ""
            detail.append(f"ours leaves out target layer{'s' if len(left_out) > 1 else ''} "
                          f"{', '.join(map(str, left_out))}{deepest}")
        if extra:
            detail.append(f"ours adds {', '.join(map(str, extra))}")
        return [Finding(
            "fc_dims", "divergence",
            f"fc reads {len(ids_o)} target layers in ours but {len(ids_r)} in ref ({'; '.join(detail)}): "
            f"fc.weight in_features {o.fc_in_features} vs {r.fc_in_features}. Every selected layer must feed fc.",
            {"target_layer_ids": ids_o, "fc_in_features": o.fc_in_features},
            {"target_layer_ids": ids_r, "fc_in_features": r.fc_in_features}, pitfall=4, raw=raw)]
    if ids_o != ids_r:
        shifted = all(a - b == ids_o[0] - ids_r[0] for a, b in zip(ids_o, ids_r)) and abs(ids_o[0] - ids_r[0]) == 1
        why = (" Every id is shifted by one: one side reads hs[id] where z-lab reads hs[id + 1]." if shifted
               else " The drafter reads different target layers than the reference was built with.")
        return [Finding("target_layers", "divergence",
                        f"Target layers {ids_o} in ours vs {ids_r} in ref (z-lab convention).{why}",
                        ids_o, ids_r, pitfall=2 if shifted else 1, raw=raw)]
    return []


def layer_type_findings(o: DraftSpec, r: DraftSpec) -> list[Finding]:
    if o.num_hidden_layers != r.num_hidden_layers:
        return []  # a different layer count is the architecture finding's root cause
    found = []
    if o.layer_types != r.layer_types:
        differing = [i for i, (a, b) in enumerate(zip(o.layer_types, r.layer_types)) if a != b]
        found.append(Finding(
            "layer_types", "divergence",
            f"Draft layer{'s' if len(differing) > 1 else ''} {differing} use a different attention type "
            "(sliding vs full): sliding layers are causal within the block and windowed over the context.",
            list(o.layer_types), list(r.layer_types), pitfall=11))
    if "sliding_attention" in o.layer_types and o.sliding_window != r.sliding_window and o.layer_types == r.layer_types:
        found.append(Finding(
            "layer_types", "divergence",
            f"Sliding window {o.sliding_window} in ours vs {r.sliding_window} in ref: contexts longer than the "
            "smaller window are attended differently.", o.sliding_window, r.sliding_window, pitfall=11,
            key="sliding_window"))
    return found


def spec_rows(ours: Side, ref: Side) -> list[SpecRow]:
    rows = [SpecRow("format", ours.format, ref.format, ours.format, ref.format),
            SpecRow("layer-id convention", ours.layer_id_convention, ref.layer_id_convention, "zlab", "zlab")]
    for f in fields(DraftSpec):
        a, b = getattr(ours.spec, f.name), getattr(ref.spec, f.name)
        a, b = (list(a), list(b)) if isinstance(a, tuple) else (a, b)
        raw_a, raw_b = (ours.raw_layer_ids, ref.raw_layer_ids) if f.name == "target_layer_ids" else (a, b)
        rows.append(SpecRow(f.name, raw_a, raw_b, a, b))
    rows.append(SpecRow("fc_in_features", ours.spec.fc_in_features, ref.spec.fc_in_features,
                        ours.spec.fc_in_features, ref.spec.fc_in_features))
    return rows


# -- recipe ----------------------------------------------------------------------------------
def recipe_of(side: Side) -> tuple[Recipe, dict[str, str], bool]:
    """The side's recipe and per-field source; defaults from the training reference when it has none."""
    if side.recipe is not None:
        return side.recipe, {}, True
    from dflash_audit.audit.reference_defaults import reference_recipe

    recipe, sources = reference_recipe()
    return recipe, sources, False


def source_layer(recipe: Recipe, spec: DraftSpec) -> int:
    return spec.num_target_layers - 1 if recipe.verifier_source_layer is None else recipe.verifier_source_layer


def recipe_findings(ours: Side, ref: Side) -> tuple[list[Finding], dict[str, dict[str, Any]]]:
    if ours.recipe is None and ref.recipe is None:
        note = "neither checkpoint carries a recipe"
        return [], {"ours": {"recipe": None, "source": note}, "ref": {"recipe": None, "source": note}}
    (ro, src_o, has_o), (rr, src_r, has_r) = recipe_of(ours), recipe_of(ref)
    found = []
    for name, (pitfall, severity, consequence) in RECIPE_FIELDS.items():
        a, b = getattr(ro, name), getattr(rr, name)
        if name == "verifier_source_layer":
            a, b = source_layer(ro, ours.spec), source_layer(rr, ref.spec)
            if a == ours.spec.num_target_layers - 1 and b == ref.spec.num_target_layers - 1:
                continue  # both the final layer, even of targets of different depth
        if a == b:
            continue
        where = ""
        if not has_r:
            where = f" (ref carries no recipe: {src_r[name]})"
        elif not has_o:
            where = f" (ours carries no recipe: {src_o[name]})"
        found.append(Finding("recipe", severity, f"{name}: {a!r} in ours vs {b!r} in ref{where} — {consequence}.",
                             a, b, pitfall=pitfall, key=name))
    recipes = {
        "ours": {"recipe": ro.to_dict(), "source": "checkpoint" if has_o else "reference defaults", "sources": src_o},
        "ref": {"recipe": rr.to_dict(), "source": "checkpoint" if has_r else "reference defaults", "sources": src_r},
    }
    return found, recipes


# -- tensors ---------------------------------------------------------------------------------
def expected_shapes(spec: DraftSpec) -> dict[str, tuple[int, ...]]:
    """Draft-body tensor shapes a spec implies (built on the meta device: no memory)."""
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
    return "architecture" if "architecture" in components else ""


def compare_tensors(ours: Side, ref: Side, findings: list[Finding], advance) -> list[TensorRow]:
    exp_o, exp_r = expected_shapes(ours.spec), expected_shapes(ref.spec)
    rows = []
    for key in sorted(set(ours.state_dict) | set(ref.state_dict)):
        a, b = ours.state_dict.get(key), ref.state_dict.get(key)
        row = TensorRow(key, tensor_group(key), "equal",
                        ours_shape=list(a.shape) if a is not None else None,
                        ref_shape=list(b.shape) if b is not None else None,
                        ours_dtype=str(a.dtype).removeprefix("torch.") if a is not None else None,
                        ref_dtype=str(b.dtype).removeprefix("torch.") if b is not None else None)
        row.non_finite = [side for side, t in (("ours", a), ("ref", b))
                          if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all())]
        if a is None or b is None:
            row.status = "missing in ours" if a is None else "missing in ref"
            owner_spec = exp_o if a is None else exp_r  # the side lacking the tensor
            if key not in owner_spec:
                row.explained_by = shape_cause(key, findings) or "architecture"
        elif tuple(a.shape) != tuple(b.shape):
            row.status = "shape"
            if exp_o.get(key) != exp_r.get(key):
                row.explained_by = shape_cause(key, findings)
        else:
            if a.dtype != b.dtype:
                row.status = "dtype"
            diff, cosine = value_stats(a, b)
            row.max_abs_diff, row.cosine = diff, cosine
            if row.status == "equal" and diff != 0.0:
                row.status = "values differ"
        rows.append(row)
        advance()
    for side_name, side in (("ours", ours), ("ref", ref)):
        for key, t in sorted(side.verifier_tensors.items()):
            rows.append(TensorRow(key, "verifier-owned", "verifier-owned",
                                  **{f"{side_name}_shape": list(t.shape),
                                     f"{side_name}_dtype": str(t.dtype).removeprefix("torch.")}))
    return rows


@torch.no_grad()
def value_stats(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Max |a - b| and cosine similarity, in float64 so tiny differences are not rounded away."""
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    diff = float((a - b).abs().max()) if a.numel() else 0.0
    norm = float(a.norm() * b.norm())
    cosine = float(a @ b) / norm if norm > 0 else (1.0 if diff == 0 else 0.0)
    return diff, cosine


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
    owned = {side: sorted(s.verifier_tensors) for side, s in (("ours", ours), ("ref", ref)) if s.verifier_tensors}
    if owned:
        found.append(Finding(
            "weights", "info",
            "Verifier-owned tensors (" + "; ".join(f"{side}: {', '.join(k)}" for side, k in owned.items())
            + ") are copies of the target's embeddings, head and norm, not trained draft weights; not compared.",
            owned.get("ours"), owned.get("ref"), pitfall=13, key="verifier-owned"))
    return found
