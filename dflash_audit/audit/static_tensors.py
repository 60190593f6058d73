"""Static audit, the draft-body tensors: every tensor of both sides accounted for (equal, values
differ, shape, dtype, missing, unexpected, verifier-owned), a difference a config finding explains
listed as explained by it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from catalogue.findings import Finding
from dflash_audit.audit.sides import Side
from dflash_audit.audit.static_spec import expected_shapes
from dflash_audit.audit.static_vocab import explained_by_draft_vocab
from dflash_audit.audit.stream_stats import stats_all
from impl.families import head_family


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
    relative_error: float | None = None
    quantized: str = ""  # "ours Q8_0": a GGUF side stores this tensor quantized (or rounded to F16/BF16)



def tensor_group(key: str) -> str:
    parts = key.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 1 else parts[0]


def shape_cause(key: str, findings: list[Finding]) -> str:
    components = {f.component for f in findings}
    if key.startswith("fc.") and "fc_dims" in components:
        return "fc_dims"
    if any(f.key == "family" for f in findings) and ("_conv." in key or key.startswith("candidate_selector.")
                                                     or head_family(key)):
        return "architecture"
    if head_family(key) == "dspark" and "dspark_heads" in components:
        return "dspark_heads"
    if head_family(key) == "xpress" and "xpress_refiner" in components:
        return "xpress_refiner"
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
    singles = {(key, side): t for key in keys if key not in comparable
               for side, t in (("ours", ours.state_dict.get(key)), ("ref", ref.state_dict.get(key))) if t is not None}
    all_stats, finite = stats_all(comparable, singles)  # chunked float64: a tensor is never copied whole
    for key in keys:
        a, b = ours.state_dict.get(key), ref.state_dict.get(key)
        row = TensorRow(key, tensor_group(key), "equal",
                        ours_shape=list(a.shape) if a is not None else None,
                        ref_shape=list(b.shape) if b is not None else None,
                        ours_dtype=str(a.dtype).removeprefix("torch.") if a is not None else None,
                        ref_dtype=str(b.dtype).removeprefix("torch.") if b is not None else None)
        if a is None or b is None or tuple(a.shape) != tuple(b.shape):
            row.non_finite = [side for side in ("ours", "ref") if not finite.get((key, side), True)]
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
                row.relative_error = stats.relative_error
                quantized = [f"{name} {side.gguf['quantized'][key]}" for name, side in (("ours", ours), ("ref", ref))
                             if key in side.gguf.get("quantized", {})]
                if quantized:  # the GGUF side's own rounding: a quantization finding, not a weight difference
                    row.quantized, row.explained_by = quantized[0], "quantization"
        if row.status not in ("equal", "dtype") and explained_by_draft_vocab(key, findings):
            row.explained_by = "draft_vocab"
        rows.append(row)
        advance()
    for side_name, side in (("ours", ours), ("ref", ref)):
        for key, t in sorted(side.verifier_tensors.items()):
            rows.append(TensorRow(key, "verifier-owned", "verifier-owned",
                                  **{f"{side_name}_shape": list(t.shape),
                                     f"{side_name}_dtype": str(t.dtype).removeprefix("torch.")}))
    return rows


def is_float_dtype(name: str | None) -> bool:
    return name is not None and getattr(torch, name).is_floating_point


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
    # Integers where the other side holds floating-point weights are other numbers, not a rounding of them.
    kinds = [r for r in body if r.status == "dtype" and is_float_dtype(r.ours_dtype) != is_float_dtype(r.ref_dtype)]
    if kinds:
        found.append(Finding(
            "weights", "divergence",
            f"{len(kinds)} tensor(s) hold integers on one side and floating-point weights on the other (first: "
            f"{kinds[0].key}, {kinds[0].ours_dtype} vs {kinds[0].ref_dtype}): a dtype-class mismatch, the values "
            "are not weights of the same kind.", kinds[0].ours_dtype, kinds[0].ref_dtype, key="dtype-class"))
    dtype = [r for r in body if r.status == "dtype" and r not in kinds]
    if dtype:
        found.append(Finding(
            "weights", "divergence" if expect_identical else "warning",
            f"{len(dtype)} tensor(s) are stored in a different dtype (first: {dtype[0].key}, "
            f"{dtype[0].ours_dtype} vs {dtype[0].ref_dtype}): outputs differ by rounding.",
            dtype[0].ours_dtype, dtype[0].ref_dtype, key="dtype"))
    compared = [r for r in body if r.max_abs_diff is not None]
    differing = [r for r in compared if r.max_abs_diff and not r.explained_by]
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
    found += quantization_findings(body)
    found += ignored_entry_findings(ours, ref)
    owned = {side: sorted(s.verifier_tensors) for side, s in (("ours", ours), ("ref", ref)) if s.verifier_tensors}
    if owned:
        found.append(Finding(
            "weights", "info",
            "Verifier-owned tensors (" + "; ".join(f"{side}: {', '.join(k)}" for side, k in owned.items())
            + ") are copies of the target's embeddings, head and norm, not trained draft weights; not compared.",
            owned.get("ours"), owned.get("ref"), pitfall=13, key="verifier-owned"))
    return found


def quantization_findings(rows: list[TensorRow]) -> list[Finding]:
    """Each tensor a GGUF side stores quantized, against its source: its type and what the rounding costs."""
    found = []
    for row in rows:
        if row.explained_by != "quantization":
            continue
        side, kind = row.quantized.split()
        found.append(Finding(
            "quantization", "info",
            f"{row.key} is stored as {kind} in the GGUF ({side}): dequantized, it differs from the other side's by a "
            f"relative error of {row.relative_error:.3g} (largest |Δ| {row.max_abs_diff:.3g}, cosine "
            f"{row.cosine:.6f}).", kind if side == "ours" else None, kind if side == "ref" else None, key=row.key,
            raw={"type": kind, "relative_error": row.relative_error, "max_abs_diff": row.max_abs_diff}))
    return found


# Tensor-name tokens of drafter families other than DFlash (an extra tensor of one names the family).
FAMILY_TOKENS = {"DFlash2 (grouped causal convolutions, candidate selector)": ("conv", "selector", "codebook"),
                 "DSpark (Markov and confidence heads)": ("markov_head.", "confidence_head."),
                 "XPress (causal refiner head)": ("refiner_head.",)}


def unexpected_findings(rows: list[TensorRow], ours: Side, ref: Side) -> list[Finding]:
    """Tensors a side holds that no DFlash drafter of its own spec has: never dropped, always a finding."""
    found = []
    for side_name, side in (("ours", ours), ("ref", ref)):
        extra = [r.key for r in rows if r.status == f"unexpected in {side_name}" and not r.explained_by]
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
    """Training state found beside the weights (optimizer, scheduler, ...) and settings files too large to read:
    named, not audited."""
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
        for name, why in (side.foreign.get("set_aside") or {}).items():
            found.append(Finding("weights", "info", f"{side_name}: {name} beside the checkpoint: {why}.",
                                 key=f"set aside in {side_name}: {name}"))
    return found
