"""Where each block's anchor sits in the data, derived from the rows' names (never assumed from a layout): the drafter's
position ids, or where its mask cuts a block's context, or the targets' positions, each held to the data's anchor
token; then the slot-to-target shift, the late anchors and the context each block saw, held to the reference."""

from __future__ import annotations

from collections import Counter

from catalogue.findings import Finding
from dflash_audit.trace.step.state import StepState


class AlignmentAudit(StepState):
    def anchors(self, live: list, positions: list) -> dict | None:
        """Where each block's anchor sits in the data, by value: its position ids' anchor where the data holds the
        anchor's token there (for every block), else where the drafter's mask cuts each block's context (one block a
        batch element), else the one offset from the targets' positions (a block's start: most of its rows') under which
        every block's anchor token is the data's token there. None of them: unknown (said, never guessed)."""
        seq = self.cands.seq_len
        tokens = self.cands.tokens.reshape(-1).tolist()
        rows_of: dict[tuple, list[tuple[int, int]]] = {}
        batch = self.cands.tokens.reshape(-1, seq).shape[0]
        for (slot, _, _, _), pos in zip(live, positions):
            if slot is not None:
                call, b, j, k = slot
                rows_of.setdefault((call, b, j), []).append((k, pos))
        if not rows_of:
            return None
        token_of = {key: self.blocks[key[0]]["anchor_tokens"].get(key[1:]) for key in rows_of}
        # A batch element's data row: by its targets' positions, else by its context features (an element need not
        # be a data row: each (row, anchor) pair its own element); None where neither tells it.
        row_of = {}
        for key, rows in rows_of.items():
            known = [p // seq for _, p in rows if p is not None] or \
                ([self.element_rows[key[:2]]] if key[:2] in self.element_rows else [])
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

        given = {key: place(key, self.blocks[key[0]].get("positions", {}).get(key[1:])) for key in rows_of}
        if all(a is not None for a in given.values()):
            self.flow["anchors_from"] = "the drafter's position ids (the data's token at each)"
            return given
        cut = self.anchors_at_cuts(rows_of, place)
        if cut is not None:
            self.flow["anchors_from"] = ("the drafter's mask (each block's context cut at its anchor) and the data's "
                                         "token there")
            return cut
        from_anchor = bool(self.drafter_facts.get("sample_from_anchor", False))
        if any(p is None for rows in rows_of.values() for _, p in rows):
            self.note("the anchors could not be told from the data (the targets' positions are unknown and the "
                      "position ids do not place every anchor token on the data's token)")
            return None
        for shift in (0, 1, -1, 2, -2):
            found = {}
            for key, rows in rows_of.items():
                # The start most of the block's rows give: under noise on the targets, a row may be named at
                # another position whose logits are alike (the same token there), and the rest still tell the anchor.
                a, count = Counter(p - k + (0 if from_anchor else 1) - shift for k, p in rows).most_common(1)[0]
                if 2 * count <= len(rows) or a // seq != row_of[key] or tokens[a] != token_of[key]:
                    break
                found[key] = a
            else:
                self.flow["anchors_from"] = "the targets' positions and the data's tokens"
                return found
        self.note("the anchors could not be told from the data (no offset of the targets' positions puts every "
                  "block's anchor token on the data's token): the targets' alignment is not checked")
        return None

    def anchors_at_cuts(self, rows_of: dict, place) -> dict | None:
        """Each (row, anchor) pair its own batch element of the drafter's call, its context cut by the drafter's mask
        at the anchor: the anchor is where the context it sees ends (it sees positions 0..a-1, the reference's
        context), placed by `place` where the data holds the anchor's token. None unless every block is found so."""
        per_element = Counter(key[:2] for key in rows_of)
        found = {}
        for key in rows_of:
            seen = self.context_masks.get(key[:2])
            if seen is None or per_element[key[:2]] != 1 or seen != list(range(len(seen))):
                return None
            found[key] = place(key, len(seen))
            if found[key] is None:
                return None
        return found or None

    def alignment(self, live: list, positions: list, anchors: dict) -> None:
        from_anchor = bool(self.drafter_facts.get("sample_from_anchor", False))
        shifts = Counter()
        for (slot, _, _, _), pos in zip(live, positions):
            if slot is None or pos is None or slot[:3] not in anchors:
                continue
            shifts[pos - (anchors[slot[:3]] + slot[3] - (0 if from_anchor else 1))] += 1
        seq, length = self.cands.seq_len, self.block_length
        late = sorted({a % seq for a in anchors.values() if a % seq + length > seq})
        if late:
            self.add(Finding("anchors", "divergence", f"anchors {late} leave no room for a whole block in {seq} "
                             f"tokens (the reference excludes the last {length} positions)", late, None, pitfall=8,
                             key="late_anchors"), edge="block")
        for call, block in self.blocks.items():
            if "mask" in block:
                known = {key[1:]: a % seq for key, a in anchors.items() if key[0] == call}
                self.training_mask(self.tensors[block["mask"]], block, known, call)
        if not shifts:
            return
        shift, count = shifts.most_common(1)[0]
        self.flow["target_shift"] = shift
        if shift != 0 and count >= sum(shifts.values()) / 2:
            self.add(Finding("target_alignment", "divergence",
                             f"the targets are shifted by {shift:+d}: slot k of the block at anchor a is trained "
                             f"toward the target's logits at position a + k{f'{shift - 1:+d}' if shift != 1 else ''}; "
                             "the reference (DFlash, sample_from_anchor false) takes them at a + k - 1", shift, 0,
                             pitfall=5, key="shift", raw={"rows": dict(shifts)}), edge="targets")
