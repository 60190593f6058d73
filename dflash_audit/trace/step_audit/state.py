"""What every part of one step's audit shares: the step's recorded tensors and their manifest entries, the target's
candidates, the reference, and what the audit has said so far (each tensor's row in the report, the findings, the
notes, the data flow). The parts (blocks.py, context.py, draft_rows.py, targets.py, alignment.py, recipe.py) each
add their methods to `StepAudit` (audit.py) on top of this state.

State a part writes for the parts after it: `blocks` (per drafter call: its block token ids, each token's
(batch row, block, slot), the anchor tokens, the block positions, the training mask's name), `mask_id` and
`block_length` (blocks.py); `context_kept`, `context_masks` (the rows compared, the context each batch element sees)
and `element_rows` (each batch element's data row) (context.py); `draft_rows`, `draft_slots`, `draft_prefix`
(draft_rows.py); `label_places` (targets.py); `anchor_at` (alignment.py); `fitted` (recipe.py). Which rows of a
tensor are evidence at all is `masked_rows`' (row_masks.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from catalogue.findings import Finding
from dflash_audit.target_values import TargetCandidates, tolerance
from dflash_audit.trace.step_audit.reference import Reference
from dflash_audit.trace.step_audit.row_masks import context_seen, is_mask_keyword, padding_rows

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
    """One recorded step against the target's candidates: the shared state and the bookkeeping every part uses."""

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
        self.blocks: dict[int, dict] = {}  # drafter call -> its block tokens, slots, positions, mask
        self.mask_id: int | None = None
        self.block_length: int | None = None
        self.draft_rows: torch.Tensor | None = None
        self.draft_slots: list = []
        self.draft_prefix: list[str] = []  # each draft row's micro-batch
        self.fitted: dict[str, Any] | None = None  # the weights per slot, fitted (recipe.py)
        self.anchor_at: dict = {}  # (call, batch row, block) -> its anchor's flat place in the data (alignment.py)
        self.label_places: list | None = None  # hard labels: each row's flat place its argmax was read at (targets.py)
        self.context_kept: dict[str, torch.Tensor] = {}  # fed context -> the indices of its rows compared (context.py)
        self.element_rows: dict[tuple[int, int], int] = {}  # (call, batch element) -> its data row (context.py)
        self.context_masks: dict[tuple[int, int], list[int]] = {}  # (call, batch element) -> context it sees

    def masked_rows(self, name: str, context: bool = False) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]],
                                                                      list[str]]:
        """Which of a recorded tensor's rows (laid out as `as_rows`) the step's recorded masks leave as evidence, what
        each mask left out (in words, with the rows), and the drafter masks read (row_masks.py): the target's attention mask over a
        tensor laid out as its input; for the drafter's context features (`context`), its own call's masks too."""
        t = self.tensors[name]
        keep = torch.ones(t.reshape(-1, t.shape[-1]).shape[0] if t.dim() else 1, dtype=torch.bool)
        said, used = [], []
        for n in self.of_role("target_attention_mask"):
            pad = padding_rows(self.tensors[n], list(t.shape)) if micro_batch(n) == micro_batch(name) else None
            if pad is not None and bool((pad & keep).any()):
                said.append((f"{int((pad & keep).sum())} rows of padding under the target's attention mask", pad & keep))
                keep &= ~pad
        call = self.entries[name].get("call")
        if not context or t.dim() < 2 or call is None:
            return keep, said, used
        elements, width = t.shape[:-2].numel(), t.shape[-2]
        queries = self.blocks[call]["ids"].shape[-1] if call in self.blocks else 0
        for n in self.of_role("drafter_kwarg"):
            kwarg = str(self.entries[n].get("kwarg", ""))
            if self.entries[n].get("call") != call or not is_mask_keyword(kwarg):
                continue
            seen = context_seen(self.tensors[n], kwarg, elements, width, queries)
            if seen is None:
                continue
            used.append(n)
            for e, row in enumerate(seen.tolist()):
                self.context_masks[(call, e)] = [i for i, x in enumerate(row) if x]
            hidden = ~seen.reshape(-1) & keep
            if bool(hidden.any()):
                said.append((f"{int(hidden.sum())} rows the drafter's {kwarg} hides", hidden))
                keep &= ~hidden
        return keep, said, used

    def evidence_rows(self, name: str) -> torch.Tensor:
        """A recorded tensor's rows ([rows, width], its own dtype) less those the target's attention mask excludes
        (`masked_rows`): a view of them all where it excludes none."""
        keep, _, _ = self.masked_rows(name)
        t = self.tensors[name]
        rows = t.reshape(-1, t.shape[-1])
        return rows[keep] if bool(keep.any()) and not bool(keep.all()) else rows

    def left_out(self, name: str) -> str:
        """What `evidence_rows` left out of a tensor, in words ("" for nothing)."""
        _, said, _ = self.masked_rows(name)
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
