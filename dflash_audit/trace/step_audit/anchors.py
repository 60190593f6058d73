"""Where each block's anchor sits in the data, derived from the rows' names (never assumed from a layout): the drafter's
position ids, or where its mask cuts a block's context, or the targets' positions, each held to the data's anchor
token. Unknown where none of them tells it (said, never guessed).

The stage: `place_anchors(step, blocks, context, loss, targets) -> Anchors`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from dflash_audit.trace.step_audit.blocks import Blocks
from dflash_audit.trace.step_audit.context import Context
from dflash_audit.trace.step_audit.loss_rows import LossRows
from dflash_audit.trace.step_audit.state import StepState
from dflash_audit.trace.step_audit.targets import Targets


@dataclass
class Anchors:
    """(call, batch row, block) -> its anchor's flat place in the target's rerun (`at`); None: not told."""
    at: dict | None

    @property
    def places(self) -> dict:
        """The anchors found, none where they were not told."""
        return self.at or {}


def place_anchors(step: StepState, blocks: Blocks, context: Context, loss: LossRows, targets: Targets) -> Anchors:
    """The anchors of the loss's live rows' blocks (`find_anchors`), told from the targets' positions where
    they were named (hard labels: none)."""
    live = loss.live
    return Anchors(find_anchors(step, blocks, context, live, targets.positions or [None] * len(live)))


def find_anchors(step: StepState, blocks: Blocks, context: Context, live: list, positions: list) -> dict | None:
    """Where each block's anchor sits in the data, by value: its position ids' anchor where the data holds the
    anchor's token there (for every block), else where the drafter's mask cuts each block's context (one block a
    batch element), else the one offset from the targets' positions (a block's start: most of its rows') under which
    every block's anchor token is the data's token there. None of them: unknown (said, never guessed)."""
    seq = step.cands.seq_len
    tokens = step.cands.tokens.reshape(-1).tolist()
    rows_of: dict[tuple, list[tuple[int, int]]] = {}
    batch = step.cands.tokens.reshape(-1, seq).shape[0]
    for (slot, _, _, _), pos in zip(live, positions):
        if slot is not None:
            call, b, j, k = slot
            rows_of.setdefault((call, b, j), []).append((k, pos))
    if not rows_of:
        return None
    token_of = {key: blocks.calls[key[0]]["anchor_tokens"].get(key[1:]) for key in rows_of}
    # A batch element's data row: by its targets' positions, else by its context features (an element need not
    # be a data row: each (row, anchor) pair its own element); None where neither tells it.
    row_of = {}
    for key, rows in rows_of.items():
        known = [p // seq for _, p in rows if p is not None] or \
            ([context.element_rows[key[:2]]] if key[:2] in context.element_rows else [])
        row_of[key] = Counter(known).most_common(1)[0][0] if known else None

    def place(key: tuple, a: int | None) -> int | None:
        """The flat place of the block's anchor at position a, where the data holds its token: in its data row,
        else (unknown) its batch row, else the one data row holding the token there."""
        if a is None or a not in range(seq):
            return None
        rows = [row_of[key]] if row_of[key] is not None else \
            [min(key[1], batch - 1)] + [r for r in range(batch) if r != min(key[1], batch - 1)]
        holding = [r for r in rows if tokens[r * seq + a] == token_of[key]]
        if row_of[key] is None and holding and holding[0] != min(key[1], batch - 1) and len(holding) > 1:
            return None  # not its batch row, and several rows hold the token there: not told
        return holding[0] * seq + a if holding else None

    given = {key: place(key, blocks.calls[key[0]].get("positions", {}).get(key[1:])) for key in rows_of}
    if all(a is not None for a in given.values()):
        step.flow["anchors_from"] = "the drafter's position ids (the data's token at each)"
        return given
    cut = anchors_at_cuts(context, rows_of, place)
    if cut is not None:
        step.flow["anchors_from"] = ("the drafter's mask (each block's context cut at its anchor) and the data's "
                                     "token there")
        return cut
    from_anchor = bool(step.drafter_facts.get("sample_from_anchor", False))
    if any(p is None for rows in rows_of.values() for _, p in rows):
        step.note("the anchors could not be told from the data (the targets' positions are unknown and the "
                  "position ids do not place every anchor token on the data's token)")
        return None
    for shift in (0, 1, -1, 2, -2):
        found = {}
        for key, rows in rows_of.items():
            # The start most of the block's rows give: under noise on the targets, a row may be named at another
            # position whose logits are alike (the same token there), and the rest still tell the anchor.
            a, count = Counter(p - k + (0 if from_anchor else 1) - shift for k, p in rows).most_common(1)[0]
            if 2 * count <= len(rows) or a // seq != row_of[key] or tokens[a] != token_of[key]:
                break
            found[key] = a
        else:
            step.flow["anchors_from"] = "the targets' positions and the data's tokens"
            return found
    step.note("the anchors could not be told from the data (no offset of the targets' positions puts every "
              "block's anchor token on the data's token): the targets' alignment is not checked")
    return None


def anchors_at_cuts(context: Context, rows_of: dict, place) -> dict | None:
    """Each (row, anchor) pair its own batch element of the drafter's call, its context cut by the drafter's mask
    at the anchor: the anchor is where the context it sees ends (it sees positions 0..a-1, the reference's
    context), placed by `place` where the data holds the anchor's token. None unless every block is found so."""
    per_element = Counter(key[:2] for key in rows_of)
    found = {}
    for key in rows_of:
        seen = context.masks.get(key[:2])
        if seen is None or per_element[key[:2]] != 1 or seen != list(range(len(seen))):
            return None
        found[key] = place(key, len(seen))
        if found[key] is None:
            return None
    return found or None
