"""The draft rows: every draft-logit row of every drafter call, with the block slot it drafts, as centred
log-probabilities; the loss's rows (loss_rows.py) are each found among them by value (`DraftRows.slot_of`).

The stage: `read_draft_rows(step, blocks) -> DraftRows`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_audit.target_values import CHUNK_ROWS, centered_log_probs
from dflash_audit.trace.step_audit.blocks import Blocks
from dflash_audit.trace.step_audit.state import StepState, as_rows, micro_batch


@dataclass
class DraftRows:
    """Every draft row as centred log-probabilities (`table`, None without draft logits), each row's slot
    ((call, batch row, block, slot) or None: `slots`) and micro-batch (`prefix`)."""
    table: torch.Tensor | None = None
    slots: list = field(default_factory=list)
    prefix: list[str] = field(default_factory=list)

    def slot_of(self, log_probs: torch.Tensor, prefix: str | None = None) -> list:
        """Each row's draft slot (call, batch row, block, slot), found by value among the draft logits."""
        if self.table is None or log_probs.shape[-1] != self.table.shape[-1]:
            return [None] * log_probs.shape[0]
        rows = centered_log_probs(log_probs)
        table, slots = self.table, self.slots
        if prefix is not None:  # a micro-batch's loss rows are among its own draft rows
            own = [i for i, p in enumerate(self.prefix) if p == prefix]
            if own:
                table, slots = table[own], [slots[i] for i in own]
        # The nearest few by the matrix-product shortcut, then their exact distances (the shortcut's rounding can
        # swap two near-equal slots' rows); in chunks of rows, never [rows, few, vocabulary] at once.
        near_few = torch.cat([torch.cdist(rows[s:s + CHUNK_ROWS], table).topk(min(4, table.shape[0]), largest=False)
                              .indices for s in range(0, rows.shape[0], CHUNK_ROWS)])
        exact = torch.stack([(rows[r] - table[near_few[r]]).norm(dim=-1) for r in range(rows.shape[0])]) \
            if rows.shape[0] else torch.zeros(0, near_few.shape[1])
        best = exact.min(1).values
        used: set[int] = set()
        found = []
        for r in range(rows.shape[0]):  # equal draft rows (a drafter blind to position): the next one, in order
            ties = near_few[r][exact[r] <= best[r] + 1e-6 + 1e-4 * best[r]].tolist()
            i = next((t for t in ties if t not in used), ties[0])
            used.add(i)
            near = float((rows[r] - table[i]).abs().max()) <= 1e-2
            found.append(slots[i] if near else None)
        return found


def read_draft_rows(step: StepState, blocks: Blocks) -> DraftRows:
    """Every draft-logit row of every call, with the block slot it drafts (its call's block token at the same
    place), as centred log-probabilities to find the loss's rows in by value."""
    found = DraftRows()
    rows = []
    for name in step.of_role("draft_logits"):
        logits = step.tensors[name]
        call = step.entries[name].get("call")
        block = blocks.calls.get(call)
        flat = as_rows(logits)
        known = block is not None and len(block["slots"]) == flat.shape[0]
        step.account(name, "the draft logits (the head's output on the drafter's hidden states"
                     + (f", drafter call {call})" if known else "; their block slots unknown)"))
        rows.append(centered_log_probs(flat))
        found.prefix.extend([micro_batch(name)] * flat.shape[0])
        found.slots.extend([(call, *s) if s is not None else None for s in block["slots"]] if known
                           else [None] * flat.shape[0])
    found.table = torch.cat(rows) if rows else None
    return found
