"""The loss's rows, read from its gradient on the draft log-probabilities: for KL or cross-entropy toward p, row r's
gradient is -c_r * p_r, its weight and its target, whatever code computed them. Each loss row is found by value among
the draft rows (draft_rows.py); the targets, the anchors, the weights and the loss kind are then read from these rows
(targets.py, anchors.py, labels.py, alignment.py, weights.py, recipe.py).

The stage: `read_loss_rows(step, draft) -> LossRows`; without the gradient, `loss_unread` says the loss is not
audited."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from catalogue.findings import Finding
from dflash_audit.target_values import CHUNK_ROWS, centered_log_probs
from dflash_audit.trace.step_audit.draft_rows import DraftRows
from dflash_audit.trace.step_audit.state import StepState, as_rows, micro_batch


@dataclass
class LossRows:
    """The loss's inputs by kind (the recorded target distributions, the hard labels: names), and each row of the
    loss read from its gradient (`trained`: (slot, weight c, target p or None, draft log q), weight-0 rows of a known
    slot included), those of them with a weight (`live`), and whether every live target is one-hot (`hard`)."""
    distributions: list[str]
    labels: list[str]
    trained: list[tuple]
    live: list[tuple]
    hard: bool


def read_loss_rows(step: StepState, draft: DraftRows) -> LossRows:
    """The loss's inputs sorted by kind, then each row of the loss read from its gradient (its weight and target) and
    found among the draft rows."""
    vocab = step.vocab
    for n in step.of_role("loss_draft_side"):
        step.account(n, "the draft side of the loss (log-probabilities of the draft logits)"
                     if step.tensors[n].shape[-1] == vocab else
                     f"a draft-side tensor of the loss {step.tensors[n].shape[-1]} wide")
    inputs = step.of_role("loss_input")
    # A distribution per trained row: vocabulary-wide rows. One row as wide as the vocabulary beside many draft
    # rows is a per-row constant (weights, a mask) whose length happens to equal the vocabulary's.
    draft_rows = max((as_rows(step.tensors[n]).shape[0] for n in step.of_role("loss_draft_side")
                      if step.tensors[n].shape[-1] == vocab), default=1)
    distributions = [n for n in inputs if step.tensors[n].is_floating_point() and
                     step.tensors[n].dim() and step.tensors[n].shape[-1] == vocab and
                     (as_rows(step.tensors[n]).shape[0] > 1 or draft_rows == 1)]
    labels = [n for n in inputs if not step.tensors[n].is_floating_point() and step.tensors[n].dtype != torch.bool
              and (str(step.entries[n].get("node", "")).startswith("NllLoss")
                   or step.entries[n].get("attr") == "target")]
    for n in inputs:
        if n not in distributions and n not in labels:
            t = step.tensors[n]
            value = f", value {float(t.flatten()[0]):.6g}" if t.numel() == 1 else ""
            step.account(n, f"a constant of the loss (node {step.entries[n].get('node', '?')}{value}; the "
                            "weights and the reduction are read from the loss's gradient)")
    # Each trained row: its weight c (reduction included) and its target p, from the loss's gradient.
    trained = []  # (slot, c, p row, log q row)
    read: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # gradient -> (its live rows, their targets)
    for g_name in step.of_role("loss_gradient"):
        lq_name = step.entries[g_name].get("of")
        if lq_name not in step.tensors:
            continue
        g, lq = as_rows(step.tensors[g_name]), as_rows(step.tensors[lq_name])
        c = -g.sum(-1)
        step.account(g_name, f"the loss's gradient on {lq_name}: each row's weight and target")
        slots = draft.slot_of(lq, micro_batch(g_name))
        top = float(c.abs().max()) if c.numel() else 0.0
        live_rows = (c.abs() > 1e-7 * top) if top else torch.zeros_like(c, dtype=torch.bool)
        targets = g / -torch.where(live_rows, c, torch.ones_like(c))[:, None]
        read[g_name] = (live_rows, targets)
        for r, (weight, on) in enumerate(zip(c.tolist(), live_rows.tolist())):
            if on:
                trained.append((slots[r], weight, targets[r], lq[r]))
            elif slots[r] is not None:
                trained.append((slots[r], 0.0, None, lq[r]))
    for n in distributions:
        leave_out_unread(step, n, read)
    step.flow["loss"] = f"{float(step.meta['loss']):.6g}"
    live = [t for t in trained if t[1] > 0]
    if trained:
        step.flow["loss_rows"] = len(live)
    hard = bool(live) and all(float(p.max()) > 1 - 1e-4 for _, _, p, _ in live)
    return LossRows(distributions, labels, trained, live, hard)


def leave_out_unread(step: StepState, name: str, read: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The rows of a recorded target tensor the loss does not read, left out of every by-value reading of it (the
    targets' naming, the noise's fit; `StepState.leave_out`): a tensor laid out row for row as the draft
    log-probabilities a gradient is on, whose every row of weight is that row's target by value (so row r of the
    one is row r of the other), leaves its rows of weight 0 unread (a slot never trained: whatever the tensor holds
    there, zeros or a real target, nothing the step trains reads it)."""
    rows = as_rows(step.tensors[name])
    for g_name, (live, targets) in read.items():
        if micro_batch(g_name) != micro_batch(name) or live.shape[0] != rows.shape[0] or bool(live.all()) \
                or not bool(live.any()):
            continue
        if same_distributions(rows, targets, live.nonzero().flatten()):
            step.leave_out(name, ~live, "rows the loss does not read (their weight 0 in its gradient)")
            return


def same_distributions(recorded: torch.Tensor, targets: torch.Tensor, index: torch.Tensor) -> bool:
    """At each row of `index`, the recorded row (logits, log-probabilities or probabilities) the same distribution
    as the target row (L1 within 1e-3, as `targets.twins`), in chunks of rows."""
    for start in range(0, index.shape[0], CHUNK_ROWS):
        rows = index[start:start + CHUNK_ROWS]
        if float((centered_log_probs(recorded[rows]).softmax(-1) - targets[rows]).abs().sum(-1).max()) > 1e-3:
            return False
    return True


def loss_unread(step: StepState) -> None:
    """No gradient on the draft log-probabilities recorded: the weights and the loss are not audited (said)."""
    step.findings.append(Finding("loss", "warning", "the loss's gradient on the draft log-probabilities was not "
                                 "recorded: the weights and the loss are not audited", None, None, key="unread"))
