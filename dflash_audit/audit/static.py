"""Static audit: two drafters' specs, recipes and draft-body tensors, compared without running them.

One root cause, one finding: a tensor whose shape differs because the configs differ is
listed in the tensor table as "explained by" that config finding, never again under
`weights`. Layer ids are compared normalized (z-lab convention), so the same drafter in
z-lab and speculators form gives no finding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from catalogue.findings import Finding
from dflash_audit.audit.sides import Side
from dflash_audit.audit.static_recipe import recipe_findings
from dflash_audit.audit.static_rotary import rotary_findings
from dflash_audit.audit.static_spec import (
    SpecRow,
    self_findings,
    shape_contradictions,
    spec_findings,
    spec_rows,
)
from dflash_audit.audit.static_target import size_table, target_findings
from dflash_audit.audit.static_tensors import (
    TensorRow,
    compare_tensors,
    weight_findings,
)
from dflash_audit.audit.static_vocab import draft_vocab_findings
from foundation.target_vocab import TargetVocabulary


@dataclass
class StaticAudit:
    findings: list[Finding]
    spec_rows: list[SpecRow]
    tensor_rows: list[TensorRow]
    recipes: dict[str, dict[str, Any]]  # side -> {"recipe": {...}, "source": "checkpoint" | reference}
    target_vocabulary: dict[str, Any] | None = None  # with a target: its sizes and special ids, each drafter's head


def static_audit(ours: Side, ref: Side, expect_identical: bool = False, advance=lambda: None,
                 target: TargetVocabulary | None = None) -> StaticAudit:
    """All static findings of `ours` against `ref` (and against `target`'s vocabulary, when given). `advance`
    is called once per compared tensor."""
    findings = (self_findings(ours, "ours") + self_findings(ref, "ref") + shape_contradictions(ours, "ours")
                + shape_contradictions(ref, "ref") + spec_findings(ours, ref) + rotary_findings(ours, ref)
                + draft_vocab_findings(ours, ref))
    if target is not None:
        against_target = target_findings(ours, ref, target)
        if any(f.component == "vocab_sizes" and f.severity == "divergence" for f in against_target):
            # The drafters' vocab_size differs because one (or both) differs from the target's: that root cause.
            findings = [f for f in findings if not (f.component == "architecture" and f.key == "target_vocab_size")]
        findings += against_target
    recipe_found, recipes = recipe_findings(ours, ref)
    tensor_rows = compare_tensors(ours, ref, findings, advance)
    findings += recipe_found + weight_findings(tensor_rows, ours, ref, expect_identical)
    return StaticAudit(findings=findings, spec_rows=spec_rows(ours, ref), tensor_rows=tensor_rows, recipes=recipes,
                       target_vocabulary=size_table(ours, ref, target) if target is not None else None)
