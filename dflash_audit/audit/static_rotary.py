"""Static audit, the rotary settings (#35): rope_theta, rope scaling, partial rotary factor and style.

Two comparisons, one finding per root cause:
- each drafter's declared settings against what the reference its format is written for applies (z-lab's
  DFlashDraftModel, speculators' trainer: transformers' Qwen3RotaryEmbedding, whose default rope ignores
  `partial_rotary_factor`, and rotate_half only). A config that inherited a factor its trainer never applied
  is one finding, on that side;
- the two drafters against each other, on what each one's reference applies where that is known (else on
  what it declares), so the inherited factor above is not reported a second time.
How serving engines read the same fields is entry #30 (`serve-check`), not repeated here.
"""

from __future__ import annotations

from typing import Any

from catalogue.pitfalls import ROTARY_CONSEQUENCES
from catalogue.findings import Finding
from dflash_audit.audit.sides import Side
from dflash_audit.audit.static_spec import default_aware
from impl.rotary_config import FORMAT_REFERENCE, applied_settings
from impl.spec import ROTARY_FIELDS


def describe(name: str, value: Any) -> str:
    if name == "rope_scaling":
        return "unscaled" if value is None else f"{value.get('rope_type')} scaling {value}"
    return f"{name} {value}"


def applied(side: Side) -> tuple[dict[str, Any], dict[str, str]]:
    """The rotary settings the side's reference applies, and why each differs from what the side declares.

    Only for z-lab and speculators directories with known settings: our trainer applies its spec as written, and
    a foreign checkpoint's trainer is unknown (its declared values stand)."""
    if side.format not in FORMAT_REFERENCE or not all(side.is_known(name) for name in ROTARY_FIELDS):
        return {}, {}
    return applied_settings(side.format, {name: side.value(name) for name in ROTARY_FIELDS})


def declared_vs_applied(ours: Side, ref: Side) -> list[Finding]:
    """Each setting a side declares but its reference does not apply; both sides declaring the same such value
    (twins that inherited one config) is one finding."""
    sides = {"ours": (ours, *applied(ours)), "ref": (ref, *applied(ref))}
    found = []
    for name in ROTARY_FIELDS:
        who = [label for label, (side, _, why) in sides.items() if name in why]
        declared = {label: sides[label][0].value(name) for label in who}
        reasons = {label: [sides[label][2][name]] for label in who}
        if len(who) == 2 and declared["ours"] == declared["ref"]:
            who = ["ours and ref"]
            sides["ours and ref"] = sides["ours"]
            declared["ours and ref"] = declared["ours"]
            reasons["ours and ref"] = list(dict.fromkeys(reasons["ours"] + reasons["ref"]))  # one per reference
        for label in who:
            side, values, _ = sides[label]
            detail = side.provenance.get(name, {}).get("detail", "")
            found.append(Finding(
                "rotary", "divergence",
                f"{label} declare{'' if ' and ' in label else 's'} {describe(name, declared[label])} ({detail}), "
                f"but {'; and '.join(reasons[label])}. An engine that applies the declared value (how vLLM and "
                f"SGLang read it: #30) serves another function than the reference runs: {ROTARY_CONSEQUENCES[name]}.",
                declared[label] if label != "ref" else None, declared[label] if label != "ours" else None,
                pitfall=35, key=f"{name} applied in {label}",
                raw={label: {"declared": declared[label], "applied": values[name]}}))
    return found


def rotary_findings(ours: Side, ref: Side) -> list[Finding]:
    found = declared_vs_applied(ours, ref)
    effective = [applied(side)[0] for side in (ours, ref)]
    for name in ROTARY_FIELDS:
        if not (ours.is_known(name) and ref.is_known(name)):
            continue  # an unknown is reported as unknown (static_spec.self_findings), never compared
        a, b = (values.get(name, side.value(name)) for values, side in zip(effective, (ours, ref)))
        if a == b or None in (a, b) and name == "partial_rotary_factor":
            continue  # equal, or one side cannot run its factor at all (its own finding above)
        found.append(default_aware(ours, ref, name, Finding(
            "rotary", "divergence",
            f"{describe(name, a)} in ours vs {describe(name, b)} in ref: {ROTARY_CONSEQUENCES[name]}.",
            a, b, pitfall=35, key=name)))
    return found
