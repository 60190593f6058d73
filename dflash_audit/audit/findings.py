"""A finding: one root cause of a difference between two drafters, in the report's vocabulary (docs/reports.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from catalogue.pitfalls import PITFALLS as CATALOGUE

COMPONENTS = ("fc_dims", "target_layers", "layer_types", "window_direction", "block_size", "mask_token", "serving",
              "architecture", "conv", "selector", "dspark_heads", "xpress_refiner", "weights", "recipe", "tau", "mask_token_validity", "vocab_sizes",
              "slot_layout", "rotary", "draft_vocab", "quantization",
              # `trace`: what one recorded training step computed (dflash_audit/trace/audit.py)
              "targets", "target_alignment", "noise", "loss_weights", "loss", "positions", "training_mask",
              "anchors", "unexplained")
SEVERITIES = ("divergence", "warning", "info")

# What each catalogue entry (catalogue/pitfalls.py, docs/pitfalls.md) is about, for the report's "see entry #n" links.
PITFALLS = {n: p.title for n, p in CATALOGUE.items()}


@dataclass
class Finding:
    component: str
    severity: str
    message: str  # one plain-language sentence: what differs and what it does
    ours: Any  # normalized values (z-lab layer-id convention)
    ref: Any
    pitfall: int | None = None  # docs/pitfalls.md entry number
    key: str = ""  # which field / tensor group, so findings of one component stay distinct
    raw: dict[str, Any] = field(default_factory=dict)  # {"ours": ..., "ref": ...} as stored on disk
    explanation: str = ""  # why it matters, for the HTML report

    def __post_init__(self) -> None:
        if self.component not in COMPONENTS:
            raise ValueError(f"unknown finding component {self.component!r}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}")

    @property
    def pitfall_title(self) -> str:
        return PITFALLS.get(self.pitfall, "") if self.pitfall else ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def divergences(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "divergence"]


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Divergences first, then warnings, then info; stable within a severity."""
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))
