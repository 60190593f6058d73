"""The ledger of one step's audit, which every stage (audit.py's `audit_step`) is handed and writes to: the step's
recorded tensors and their manifest entries, the target's candidates and the reference (what the stages read), and
what the audit has said so far: each tensor's row in the report (`account`), the findings (`add`), the notes and the
data flow. What a stage finds for the stages after it is its own typed result, passed on by `audit_step`, never kept
here. Which rows of a tensor are evidence under the target's attention mask is `masked_rows`' (row_masks.py); under
the drafter's own masks, context.py's; a row the loss does not read (its weight 0 in the loss's gradient) is no
evidence either: loss_rows.py finds them and `leave_out` keeps them here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from catalogue.findings import Finding
from dflash_audit.target_values import TargetCandidates, tolerance
from dflash_audit.trace.step_audit.reference import Reference
from dflash_audit.trace.step_audit.row_masks import padding_rows

LOOSE_GRADIENT = 1e-4  # targets read back from the loss's gradient (g / c, then log): a few float32 roundings


def micro_batch(name: str) -> str:
    """The micro-batch a recorded tensor belongs to: its `mb<n>.` prefix (the step's first: none)."""
    head = name.split(".", 1)[0]
    return head if head.startswith("mb") and head[2:].isdigit() else ""


def as_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).float()


@dataclass
class TensorRow:
    step: int
    name: str
    role: str
    shape: list[int]
    device: str
    what: str
    distance: float | None = None


class StepState:
    """One recorded step against the target's candidates: what every stage reads, and the ledger it writes to."""

    def __init__(self, meta: dict, tensors: dict[str, torch.Tensor], cands: TargetCandidates, ref: Reference,
                 pad_id: int | None, step_index: int, run: dict | None = None):
        self.meta, self.tensors, self.cands, self.ref = meta, tensors, cands, ref
        self.run_facts = run or {}  # the run recorded across steps (run/recorder.py): the optimizers, clipping
        self.entries = meta["entries"]
        self.pad_id = pad_id
        self.step = step_index
        self.findings: list[Finding] = []
        self.rows: dict[str, TensorRow] = {}
        self.hidden_size = cands.hidden_size
        self.vocab = cands.vocab
        self.flow: dict[str, Any] = {"fc_layers": [], "divergent": set()}
        self.drafter_facts = meta["drafter"]["facts"]
        self.notes: list[str] = []
        self.unread: dict[str, list[tuple[str, torch.Tensor]]] = {}  # tensor -> (why, its rows no evidence)

    def leave_out(self, name: str, rows: torch.Tensor, why: str) -> None:
        """Rows of a recorded tensor (a boolean per row, laid out as `as_rows`) that are no evidence for a reason
        other than the masks (`why`: what they are, in words), left out as the masked rows are."""
        self.unread.setdefault(name, []).append((why, rows))

    def masked_rows(self, name: str) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
        """Which of a recorded tensor's rows (laid out as `as_rows`) the target's attention mask leaves as evidence
        (over a tensor laid out as its input, row_masks.py), less those the loss does not read (`leave_out`), and
        what was left out (in words, with the rows). The drafter's context features are masked by its own call's
        masks too: context.py."""
        t = self.tensors[name]
        keep = torch.ones(t.reshape(-1, t.shape[-1]).shape[0] if t.dim() else 1, dtype=torch.bool)
        said = []
        for n in self.of_role("target_attention_mask"):
            pad = padding_rows(self.tensors[n], list(t.shape)) if micro_batch(n) == micro_batch(name) else None
            if pad is not None and bool((pad & keep).any()):
                said.append((f"{int((pad & keep).sum())} rows of padding under the target's attention mask", pad & keep))
                keep &= ~pad
        for why, rows in self.unread.get(name, []):  # rows the loss does not read (`leave_out`)
            if rows.shape == keep.shape and bool((rows & keep).any()):
                said.append((f"{int((rows & keep).sum())} {why}", rows & keep))
                keep &= ~rows
        return keep, said

    def evidence_rows(self, name: str) -> torch.Tensor:
        """A recorded tensor's rows ([rows, width], its own dtype) less those the target's attention mask excludes
        and those the loss does not read (`masked_rows`): a view of them all where none is left out."""
        keep, _ = self.masked_rows(name)
        t = self.tensors[name]
        rows = t.reshape(-1, t.shape[-1])
        return rows[keep] if bool(keep.any()) and not bool(keep.all()) else rows

    def left_out(self, name: str) -> str:
        """What `evidence_rows` left out of a tensor, in words ("" for nothing)."""
        _, said = self.masked_rows(name)
        return "".join(f"; {text} left out" for text, _ in said)

    def tol(self, name: str) -> float:
        return tolerance(self.entries[name]["dtype"])

    def account(self, name: str, what: str, distance: float | None = None) -> None:
        e = self.entries[name]
        self.rows[name] = TensorRow(self.step, name, e["role"], e["shape"], str(e.get("device", "?")), what,
                                     distance)

    def of_role(self, role: str) -> list[str]:
        return [n for n, e in self.entries.items() if e["role"] == role]

    def add(self, finding: Finding, edge: str | None = None) -> None:
        if any((f.component, f.key) == (finding.component, finding.key) for f in self.findings):
            return  # one root cause is one finding, however many calls or tensors show it
        self.findings.append(finding)
        if edge and finding.severity == "divergence":
            self.flow["divergent"].add(edge)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
