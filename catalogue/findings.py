"""A finding: one root cause, in the report's vocabulary (docs/reports.md), whoever finds it: the static audit and the
recipe's (`dflash_audit/audit/`), the τ audit, serving (`serving_engines/verdict.py`), the live check's localization
(`dflash_audit/rounds/`). One typed record, and its one serialization (`Finding.to_dict`), which
report.json, serving.json and the HTML pages (rendered from those dicts) all read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from catalogue.pitfalls import PITFALLS as CATALOGUE

COMPONENTS = ("fc_dims", "target_layers", "layer_types", "window_direction", "block_size", "mask_token", "serving",
              "architecture", "conv", "selector", "dspark_heads", "xpress_refiner", "weights", "recipe", "tau",
              "mask_token_validity", "vocab_sizes", "slot_layout", "rotary", "draft_vocab", "quantization",
              # `trace`: what one recorded training step computed (dflash_audit/trace/step_audit/audit.py)
              "targets", "target_alignment", "noise", "loss_weights", "loss", "positions", "training_mask",
              "anchors", "unexplained",
              # `eval`: a drafter evaluated with other chat-template settings than it declares (dflash_audit/tau/declared.py)
              "chat_template",
              # `data-check`: an offline hidden-state dataset (dflash_audit/data_check/check.py)
              "hidden_state_data",
              # `trace` of an evaluation: a team's evaluator held round by round to z-lab's loop (trace/evaluation.py)
              "evaluation")
SEVERITIES = ("divergence", "warning", "info")
# An audit finding's words in report.json (docs/reports.md), in order.
AUDIT_WORDS = ("component", "severity", "message", "ours", "ref", "pitfall", "key", "raw", "explanation")

# What each catalogue entry (catalogue/pitfalls.py, docs/pitfalls.md) is about, for the report's "see entry #n" links.
PITFALLS = {n: p.title for n, p in CATALOGUE.items()}


@dataclass
class Finding:
    component: str
    severity: str
    message: str  # one plain-language sentence: what differs and what it does
    # The evidence, side by side: ours vs ref, normalized (z-lab layer-id convention); serving: trained vs served;
    # a live localization: the size measured (as `ref`, what the engine did).
    ours: Any = None
    ref: Any = None
    pitfall: int | None = None  # docs/pitfalls.md entry number
    key: str = ""  # which field / tensor group, so findings of one component stay distinct (serving: the field)
    raw: dict[str, Any] = field(default_factory=dict)  # {"ours": ..., "ref": ...} as stored on disk
    explanation: str = ""  # why it matters, for the HTML report
    source: str = ""  # the engine's or the reference's file:line the finding rests on
    # A live localization's place: {"kind": input | module | tie | quantization | unlocalized, "prompt", "round"}
    # (merged: the lists "prompts", "rounds" of every round it explains), and "at" where its round is not the
    # first round the engine and the audit part at (what that round is, in words).
    localized: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.component not in COMPONENTS:
            raise ValueError(f"unknown finding component {self.component!r}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"unknown severity {self.severity!r}")

    @classmethod
    def serving(cls, field_name: str, severity: str, trained: Any, served: Any, source: str, message: str,
                pitfall: int | None = None) -> Finding:
        """An engine serving a drafter otherwise than it was trained (`serving_engines`)."""
        return cls("serving", severity, message, trained, served, pitfall=pitfall, key=field_name, source=source)

    @classmethod
    def localization(cls, kind: str, what: str, message: str, size: float | None, source: str, prompt: str,
                     round_no: int | None, at: str | None = None) -> Finding:
        """What the live check found the engine feeding or computing otherwise at a prompt's first differing round;
        `at`: the words that name its rounds where they are others ("emitted in": the round a stop id is emitted
        in), read before the list of prompts and rounds."""
        return cls("serving", "divergence", message, None, size, key=what, source=source,
                   localized={"kind": kind, "prompt": prompt, "round": round_no, **({"at": at} if at else {})})

    # The serving tables' words for the same fields (docs/serving.md).
    @property
    def field(self) -> str:
        return self.key

    @property
    def trained(self) -> Any:
        return self.ours

    @property
    def served(self) -> Any:
        return self.ref

    @property
    def kind(self) -> str | None:
        return self.localized.get("kind")

    @property
    def pitfall_title(self) -> str:
        return PITFALLS.get(self.pitfall, "") if self.pitfall else ""

    def to_dict(self) -> dict[str, Any]:
        """The one serialization, in the words of the section it is written to: a live localization
        (`serving.vllm.live.findings`), a serving finding (`serving.<engine>.findings`), an audit finding
        (report.json `findings`)."""
        data = asdict(self)  # values copied, as every writer has always had them
        if self.localized:
            place = {k: v for k, v in data["localized"].items() if k != "kind"}
            return {"field": "serving", "kind": self.kind, "what": data["key"], "message": data["message"],
                    "size": data["ref"], "source": data["source"], **place}
        if self.component == "serving":
            return {"field": data["key"], "severity": data["severity"], "trained": data["ours"],
                    "served": data["ref"], "source": data["source"], "message": data["message"],
                    "component": data["component"], "pitfall": data["pitfall"]}
        words = {name: data[name] for name in AUDIT_WORDS}
        if self.component == "chat_template":  # its key is the chat setting evaluated, `chat` in eval's table
            words["chat"] = data["key"]
        return words


def divergences(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "divergence"]


class FindingsReport:
    """What every verb's report shares (the audit's, a trace's, an evaluation's, data-check's): its findings, the
    divergences among them, and its exit status, like diff(1): 0 no divergence, 1 divergences. A report that also
    counts divergences beside its own findings (`compare --serve`: the serving checks') says how many in
    `other_divergences`."""

    findings: list[Finding]

    @property
    def divergences(self) -> list[Finding]:
        return divergences(self.findings)

    @property
    def other_divergences(self) -> int:
        return 0

    @property
    def exit_status(self) -> int:
        return 1 if self.divergences or self.other_divergences else 0


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Divergences first, then warnings, then info; stable within a severity."""
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))


def serialized(value: Any) -> Any:
    """`value` as a report writes it: every `Finding` inside it (in dicts and lists, however deep) by its one
    serialization (`Finding.to_dict`), everything else as it is. Findings stay records until this is called."""
    if isinstance(value, Finding):
        return value.to_dict()
    if isinstance(value, dict):
        return {key: serialized(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [serialized(item) for item in value]
    return value
