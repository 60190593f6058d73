"""The blocks: every drafter call's block token ids, wherever they sit (one call holding every block, one per
anchor, laid out [n_blocks, B, ...] or flattened or gathered), read by value: the mask id is the id most of them
hold, the block length the gap between the tokens that are not the mask id (the anchors); then each block's position
ids and the training mask each block saw, held to the reference."""

from __future__ import annotations

from collections import Counter

import torch

from catalogue.findings import Finding
from dflash_audit.trace.step_audit.state import StepState


class BlockAudit(StepState):
    def block_tokens(self) -> None:
        """Each drafter call's block token ids (the ids whose embedding it consumed: the same tensor, or equal by
        value), then their mask id, block length and anchor slots read from the ids themselves."""
        fed = {n: self.tensors[n] for n in self.of_role("drafter_input")}
        by_call: dict[int, tuple[str, torch.Tensor]] = {}
        for name in self.of_role("embedding_ids"):
            ids = self.tensors[name]
            consumed = self.entries[name].get("consumed_as")
            consumed = [consumed] if consumed in fed else []
            if not consumed:
                emb = self.cands.embed(ids)
                consumed = [n for n, t in fed.items() if n not in self.rows and same_rows(t, emb) and
                            float((t.float().reshape(emb.shape) - emb).abs().max()) <= self.tol(n) *
                            float(emb.abs().max())]
            if not consumed:
                self.account(name, "ids embedded outside the target's forward, not consumed by the drafter")
                continue
            for n in consumed:
                self.account(n, f"the target's embedding of the block tokens ({name})", 0.0)
            call = self.entries[consumed[0]].get("call", 0)
            by_call.setdefault(call, (name, ids))
        if not by_call:
            return
        every = torch.cat([ids.flatten() for _, ids in by_call.values()]).tolist()
        mask_id = Counter(every).most_common(1)[0][0]
        gaps, spans = Counter(), Counter()
        for _, ids in by_call.values():
            for row in ids.reshape(-1, ids.shape[-1]).tolist():
                starts = [i for i, t in enumerate(row) if t != mask_id]
                gaps.update(b - a for a, b in zip(starts, starts[1:]))
                if len(starts) == 1:
                    spans[len(row) - starts[0]] += 1
        length = (gaps or spans).most_common(1)[0][0] if (gaps or spans) else None
        if not length:
            return
        self.mask_id, self.block_length = mask_id, length
        count = 0
        for call, (name, ids) in sorted(by_call.items()):
            rows = ids.reshape(-1, ids.shape[-1])
            slots = []  # per token of the call: (row, block, slot) or None
            for b, row in enumerate(rows.tolist()):
                starts = [i for i, t in enumerate(row) if t != mask_id]
                for i in range(len(row)):
                    j = max((n for n, s in enumerate(starts) if s <= i), default=None)
                    k = i - starts[j] if j is not None else None
                    slots.append((b, j, k) if j is not None and k < length else None)
            anchors = {(b, j): row[s] for b, row in enumerate(rows.tolist())
                       for j, s in enumerate(i for i, t in enumerate(row) if t != mask_id)}
            count += len(anchors)
            self.blocks[call] = {"name": name, "ids": rows, "slots": slots, "anchor_tokens": anchors}
            self.account(name, f"block tokens (drafter call {call}): anchor + mask id {mask_id}, blocks of {length}")
            self.block_positions(call)
        self.flow["blocks"] = count
        self.block_findings()

    def block_findings(self) -> None:
        length, mask_id = self.block_length, self.mask_id
        declared, ref = self.drafter_facts.get("block_size"), self.ref.block_size
        if ref is not None and length != ref:
            self.add(Finding("block_size", "divergence",
                             f"the blocks hold {length} tokens (anchor + {length - 1} masks); {self.ref.block_source} "
                             f"declares block_size {ref}: training drafts {length - 1} tokens a block, serving "
                             f"{ref - 1}", length, ref, pitfall=16, key="block_length",
                             raw={"declared_by_drafter": declared}), edge="block")
        vocab = self.vocab
        if self.pad_id is not None and mask_id == self.pad_id:
            self.add(Finding("mask_token_validity", "divergence",
                             f"the block's mask token is id {mask_id}, the target's pad id: a mask that is the pad "
                             "token is masked out or dropped wherever padding is, and drafts condition on padding",
                             mask_id, "a dedicated id, not the pad id", pitfall=34, key="mask_is_pad"), edge="block")
        elif mask_id >= vocab:
            self.add(Finding("mask_token_validity", "divergence", f"the mask token id {mask_id} is outside the "
                             f"target's vocabulary of {vocab}", mask_id, f"< {vocab}", pitfall=34,
                             key="mask_range"), edge="block")
        elif self.ref.mask_token_id is not None and mask_id != self.ref.mask_token_id:
            self.add(Finding("mask_token", "divergence", f"the block's masked slots hold id {mask_id}; "
                             f"{self.ref.mask_source} declares mask_token_id {self.ref.mask_token_id}", mask_id,
                             self.ref.mask_token_id, pitfall=14, key="mask_token_id"), edge="block")

    def call_kwarg(self, call: int, kwarg: str) -> str | None:
        found = [n for n in self.of_role("drafter_kwarg") if self.entries[n].get("kwarg") == kwarg and
                 self.entries[n].get("call", call) == call]
        return found[0] if found else None

    def block_positions(self, call: int) -> None:
        """The block's position ids (the call's last positions, one per block token): each block's positions run
        on from its anchor's. Where its anchor sits in the data is read by value later, never from these."""
        block = self.blocks[call]
        name = self.call_kwarg(call, "position_ids")
        if name is None:
            return
        positions = self.tensors[name]
        whole = not (positions.is_floating_point() or positions.dtype == torch.bool)
        rows = block["ids"]
        width = rows.shape[-1]
        if not whole or positions.dim() == 0 or positions.shape[-1] < width:
            self.account(name, f"position ids of shape {list(positions.shape)} ({positions.dtype}): not read as the "
                               "blocks' positions")
            return
        self.account(name, f"the drafter's position ids (drafter call {call}): its context's, then the blocks'")
        flat = positions.reshape(-1, positions.shape[-1])[:, -width:]
        block["positions"] = {}
        for b in range(rows.shape[0]):
            pos = flat[b if b < flat.shape[0] else 0].tolist()
            by_block: dict[int, list[int]] = {}
            for i, slot in enumerate(block["slots"][b * width:(b + 1) * width]):
                if slot is not None:
                    by_block.setdefault(slot[1], []).append(pos[i])
            for j, seen in by_block.items():
                block["positions"][(b, j)] = seen[0]
                if seen != list(range(seen[0], seen[0] + len(seen))):
                    self.add(Finding("positions", "divergence", f"a block's positions are {seen}; the reference "
                                     "places a block at its anchor's position onward", None, None, pitfall=12,
                                     key="block_positions"), edge="block")
        mask = self.call_kwarg(call, "attention_mask")
        if mask is not None:
            block["mask"] = mask

    def unread_masks(self) -> None:
        """A drafter call's attention mask the training-mask check never reached: it needs the blocks' anchors, read
        from the loss's rows (not there without the loss's gradient, or not told from the data). Named for what it
        is, not left unexplained: the missing loss rows are the finding (`draft_rows.py`, `alignment.py`)."""
        for call, block in self.blocks.items():
            if "mask" in block and block["mask"] not in self.rows:
                self.account(block["mask"], f"the drafter's attention mask (drafter call {call}): not read as the "
                                            "training mask, the blocks' anchors unknown")

    def training_mask(self, mask: torch.Tensor, block: dict, anchors: dict, call: int) -> None:
        """A call holding the whole sequence as context and a hand-built mask: each block sees the context before
        its anchor, strictly, and no other block."""
        name = block["mask"]
        if mask.dim() < 2 or mask.numel() == 0 or mask.shape[-1] < mask.shape[-2]:
            self.account(name, f"an attention mask of shape {list(mask.shape)}, not [queries, context + queries]: "
                               "not read as the training mask")
            return
        visible = mask.reshape(-1, mask.shape[-2], mask.shape[-1])[0]
        if visible.dtype != torch.bool:
            visible = visible > -1  # an additive mask: 0 visible, -inf hidden
        q = visible.shape[0]
        context = visible.shape[1] - q
        width = block["ids"].shape[-1]
        if q != width or context != self.cands.seq_len:
            self.account(name, f"the drafter's attention mask (drafter call {call}; its context is not the whole "
                               "sequence: not read as the training mask)")
            return
        self.account(name, f"the drafter's training mask (drafter call {call})")
        for (b, j), a in sorted(anchors.items()):
            if b != 0:
                continue
            rows = [i for i, s in enumerate(block["slots"][:width]) if s is not None and s[1] == j]
            seen = visible[rows, :context].any(0).nonzero().flatten().tolist()
            if seen != list(range(min(a, context))):
                self.add(Finding("training_mask", "divergence",
                                 f"block {j} (anchor at {a}) sees context positions "
                                 f"{seen[:3]}...{seen[-1:] if seen else ''}; the reference: every position before "
                                 "its anchor, strictly", None, None, pitfall=9, key="context"), edge="block")
                return
            other = visible[rows, context:].clone()
            other[:, rows] = False
            if other.any():
                self.add(Finding("training_mask", "divergence", f"block {j}'s queries see another block's "
                                 "tokens; the reference lets a block see only itself", None, None, pitfall=9,
                                 key="cross_block"), edge="block")
                return


def same_rows(fed: torch.Tensor, embedded: torch.Tensor) -> bool:
    """The same embedding rows in any layout: `[n]` ids embedded, then fed as `[1, n, H]` or `[blocks, B, H]`."""
    return fed.numel() == embedded.numel() and fed.shape[-1:] == embedded.shape[-1:]
