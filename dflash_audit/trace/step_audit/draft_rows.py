"""The draft rows and the loss's rows: every draft-logit row with the block slot it drafts, and the loss read from
its gradient on the draft log-probabilities (for KL or cross-entropy toward p, row r's gradient is -c_r * p_r: its
weight and its target, whatever code computed them). Each loss row is found by value among the draft rows; the
targets, the anchors, the weights and the loss kind are then read from those rows (targets.py, alignment.py,
recipe.py)."""

from __future__ import annotations

import torch

from catalogue.findings import Finding
from dflash_audit.target_values import CHUNK_ROWS, centered_log_probs
from dflash_audit.trace.step_audit.state import StepState, as_rows, micro_batch


class DraftRowsAudit(StepState):
    def draft_table(self) -> None:
        """Every draft-logit row of every call, with the block slot it drafts (its call's block token at the same
        place), as centred log-probabilities to find the loss's rows in by value."""
        rows, slots = [], []
        for name in self.of_role("draft_logits"):
            logits = self.tensors[name]
            call = self.entries[name].get("call")
            block = self.blocks.get(call)
            flat = as_rows(logits)
            known = block is not None and len(block["slots"]) == flat.shape[0]
            self.account(name, "the draft logits (the head's output on the drafter's hidden states"
                         + (f", drafter call {call})" if known else "; their block slots unknown)"))
            rows.append(centered_log_probs(flat))
            self.draft_prefix.extend([micro_batch(name)] * flat.shape[0])
            slots.extend([(call, *s) if s is not None else None for s in block["slots"]] if known
                         else [None] * flat.shape[0])
        self.draft_rows = torch.cat(rows) if rows else None
        self.draft_slots = slots

    def slot_of(self, log_probs: torch.Tensor, prefix: str | None = None) -> list:
        """Each row's draft slot (call, batch row, block, slot), found by value among the draft logits."""
        if self.draft_rows is None or log_probs.shape[-1] != self.draft_rows.shape[-1]:
            return [None] * log_probs.shape[0]
        rows = centered_log_probs(log_probs)
        table, slots = self.draft_rows, self.draft_slots
        if prefix is not None:  # a micro-batch's loss rows are among its own draft rows
            own = [i for i, p in enumerate(self.draft_prefix) if p == prefix]
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

    def loss_side(self) -> None:
        vocab = self.vocab
        for n in self.of_role("loss_draft_side"):
            self.account(n, "the draft side of the loss (log-probabilities of the draft logits)"
                         if self.tensors[n].shape[-1] == vocab else
                         f"a draft-side tensor of the loss {self.tensors[n].shape[-1]} wide")
        inputs = self.of_role("loss_input")
        # A distribution per trained row: vocabulary-wide rows. One row as wide as the vocabulary beside many draft
        # rows is a per-row constant (weights, a mask) whose length happens to equal the vocabulary's.
        draft_rows = max((as_rows(self.tensors[n]).shape[0] for n in self.of_role("loss_draft_side")
                          if self.tensors[n].shape[-1] == vocab), default=1)
        distributions = [n for n in inputs if self.tensors[n].is_floating_point() and
                         self.tensors[n].dim() and self.tensors[n].shape[-1] == vocab and
                         (as_rows(self.tensors[n]).shape[0] > 1 or draft_rows == 1)]
        labels = [n for n in inputs if not self.tensors[n].is_floating_point() and self.tensors[n].dtype != torch.bool
                  and (str(self.entries[n].get("node", "")).startswith("NllLoss")
                       or self.entries[n].get("attr") == "target")]
        for n in inputs:
            if n not in distributions and n not in labels:
                t = self.tensors[n]
                value = f", value {float(t.flatten()[0]):.6g}" if t.numel() == 1 else ""
                self.account(n, f"a constant of the loss (node {self.entries[n].get('node', '?')}{value}; the "
                                "weights and the reduction are read from the loss's gradient)")
        # Each trained row: its weight c (reduction included) and its target p, from the loss's gradient.
        trained = []  # (slot, c, p row, log q row)
        for g_name in self.of_role("loss_gradient"):
            lq_name = self.entries[g_name].get("of")
            if lq_name not in self.tensors:
                continue
            g, lq = as_rows(self.tensors[g_name]), as_rows(self.tensors[lq_name])
            c = -g.sum(-1)
            self.account(g_name, f"the loss's gradient on {lq_name}: each row's weight and target")
            slots = self.slot_of(lq, micro_batch(g_name))
            top = float(c.abs().max()) if c.numel() else 0.0
            live_rows = (c.abs() > 1e-7 * top) if top else torch.zeros_like(c, dtype=torch.bool)
            targets = g / -torch.where(live_rows, c, torch.ones_like(c))[:, None]
            for r, (weight, on) in enumerate(zip(c.tolist(), live_rows.tolist())):
                if on:
                    trained.append((slots[r], weight, targets[r], lq[r]))
                elif slots[r] is not None:
                    trained.append((slots[r], 0.0, None, lq[r]))
        self.flow["loss"] = f"{float(self.meta['loss']):.6g}"
        if not trained:
            for n in distributions:
                self.targets(n)
            for n in labels:
                self.account(n, "hard labels (the loss's gradient was not recorded)")
            self.findings.append(Finding("loss", "warning", "the loss's gradient on the draft log-probabilities was "
                                         "not recorded: the weights and the loss are not audited", None, None,
                                         key="unread"))
            return
        live = [t for t in trained if t[1] > 0]
        self.flow["loss_rows"] = len(live)
        hard = bool(live) and all(float(p.max()) > 1 - 1e-4 for _, _, p, _ in live)
        positions = self.target_positions(live, distributions, hard)
        for n in labels:
            self.account(n, "hard labels (the targets are read from the loss's gradient)")
        anchors = self.anchors(live, positions or [None] * len(live))
        self.anchor_at = anchors or {}
        label_source = self.label_source(live, positions) if hard else None
        if hard and positions is None:  # hard labels: a candidate's argmax at the places they were found at
            positions = self.label_places
        if anchors is not None:
            self.alignment(live, positions or [None] * len(live), anchors)
        self.weights(trained)
        self.loss_kind(live, trained, hard, label_source)
