"""The targets' alignment, once each block's anchor is placed in the data (anchors.py): the slot-to-target shift, the
late anchors and the context each block saw (its training mask, blocks.py's `training_mask`), held to the reference.

The stage: `hold_alignment(step, blocks, loss, positions, anchors) -> Alignment`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from catalogue.findings import Finding
from dflash_audit.trace.step_audit.anchors import Anchors
from dflash_audit.trace.step_audit.blocks import Blocks, training_mask
from dflash_audit.trace.step_audit.loss_rows import LossRows
from dflash_audit.trace.step_audit.state import StepState


@dataclass
class Alignment:
    """The shift most live rows' targets sit at from the reference's place (None: not told), and the anchors too late
    for a whole block."""
    shift: int | None
    late: list[int]


def hold_alignment(step: StepState, blocks: Blocks, loss: LossRows, positions: list | None,
                   anchors: Anchors) -> Alignment:
    """The slot-to-target shift of the live rows (each at its target's place, `positions`), the late anchors and
    each drafter call's training mask, held to the reference; nothing where the anchors are unknown."""
    if anchors.at is None:
        return Alignment(None, [])
    live, positions, at = loss.live, positions or [None] * len(loss.live), anchors.at
    from_anchor = bool(step.drafter_facts.get("sample_from_anchor", False))
    shifts = Counter()
    for (slot, _, _, _), pos in zip(live, positions):
        if slot is None or pos is None or slot[:3] not in at:
            continue
        shifts[pos - (at[slot[:3]] + slot[3] - (0 if from_anchor else 1))] += 1
    seq, length = step.cands.seq_len, blocks.length
    late = sorted({a % seq for a in at.values() if a % seq + length > seq})
    if late:
        step.add(Finding("anchors", "divergence", f"anchors {late} leave no room for a whole block in {seq} "
                         f"tokens (the reference excludes the last {length} positions)", late, None, pitfall=8,
                         key="late_anchors"), edge="block")
    for call, block in blocks.calls.items():
        if "mask" in block:
            known = {key[1:]: a % seq for key, a in at.items() if key[0] == call}
            training_mask(step, step.tensors[block["mask"]], block, known, call)
    if not shifts:
        return Alignment(None, late)
    shift, count = shifts.most_common(1)[0]
    step.flow["target_shift"] = shift
    if shift != 0 and count >= sum(shifts.values()) / 2:
        step.add(Finding("target_alignment", "divergence",
                         f"the targets are shifted by {shift:+d}: slot k of the block at anchor a is trained "
                         f"toward the target's logits at position a + k{f'{shift - 1:+d}' if shift != 1 else ''}; "
                         "the reference (DFlash, sample_from_anchor false) takes them at a + k - 1", shift, 0,
                         pitfall=5, key="shift", raw={"rows": dict(shifts)}), edge="targets")
    return Alignment(shift, late)
