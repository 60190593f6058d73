"""The blocks: every drafter call's block token ids, wherever they sit (one call holding every block, one per
anchor, laid out [n_blocks, B, ...] or flattened or gathered), read by value: the mask id is the id most of them
hold, the block length the gap between the tokens that are not the mask id (the anchors); then each block's position
ids and the training mask each block saw, held to the reference. The stage: `read_blocks(step) -> Blocks`; the training
mask is checked once the anchors are known (`training_mask`, called by alignment.py), and a mask that check never
reached is named at the step's end (`unread_masks`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from catalogue.findings import Finding
from dflash_audit.trace.step_audit.state import StepState


@dataclass
class Blocks:
    """Per drafter call (`calls`): its block token ids (`name`, `ids` [rows, width]), each token's (batch row, block,
    slot) or None (`slots`), the anchor tokens (`anchor_tokens`), the block positions (`positions`) and the training
    mask's name (`mask`); the mask id and the block length. Empty, both None, where no blocks were told."""
    calls: dict[int, dict] = field(default_factory=dict)
    mask_id: int | None = None
    length: int | None = None


def read_blocks(step: StepState) -> Blocks:
    """Each drafter call's block token ids (the ids whose embedding it consumed: the same tensor, or equal by
    value), then their mask id, block length and anchor slots read from the ids themselves."""
    fed = {n: step.tensors[n] for n in step.of_role("drafter_input")}
    by_call: dict[int, tuple[str, torch.Tensor]] = {}
    for name in step.of_role("embedding_ids"):
        ids = step.tensors[name]
        consumed = step.entries[name].get("consumed_as")
        consumed = [consumed] if consumed in fed else []
        if not consumed:
            emb = step.cands.embed(ids)
            consumed = [n for n, t in fed.items() if n not in step.rows and same_rows(t, emb) and
                        float((t.float().reshape(emb.shape) - emb).abs().max()) <= step.tol(n) *
                        float(emb.abs().max())]
        if not consumed:
            step.account(name, "ids embedded outside the target's forward, not consumed by the drafter")
            continue
        for n in consumed:
            step.account(n, f"the target's embedding of the block tokens ({name})", 0.0)
        call = step.entries[consumed[0]].get("call", 0)
        by_call.setdefault(call, (name, ids))
    if not by_call:
        return Blocks()
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
        return Blocks()
    found = Blocks({}, mask_id, length)
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
        found.calls[call] = {"name": name, "ids": rows, "slots": slots, "anchor_tokens": anchors}
        step.account(name, f"block tokens (drafter call {call}): anchor + mask id {mask_id}, blocks of {length}")
        block_positions(step, found.calls[call], call)
    step.flow["blocks"] = count
    block_findings(step, found)
    return found


def block_findings(step: StepState, found: Blocks) -> None:
    length, mask_id = found.length, found.mask_id
    declared, ref = step.drafter_facts.get("block_size"), step.ref.block_size
    if ref is not None and length != ref:
        step.add(Finding("block_size", "divergence",
                         f"the blocks hold {length} tokens (anchor + {length - 1} masks); {step.ref.block_source} "
                         f"declares block_size {ref}: training drafts {length - 1} tokens a block, serving "
                         f"{ref - 1}", length, ref, pitfall=16, key="block_length",
                         raw={"declared_by_drafter": declared}), edge="block")
    vocab = step.vocab
    if step.pad_id is not None and mask_id == step.pad_id:
        step.add(Finding("mask_token_validity", "divergence",
                         f"the block's mask token is id {mask_id}, the target's pad id: a mask that is the pad "
                         "token is masked out or dropped wherever padding is, and drafts condition on padding",
                         mask_id, "a dedicated id, not the pad id", pitfall=34, key="mask_is_pad"), edge="block")
    elif mask_id >= vocab:
        step.add(Finding("mask_token_validity", "divergence", f"the mask token id {mask_id} is outside the "
                         f"target's vocabulary of {vocab}", mask_id, f"< {vocab}", pitfall=34,
                         key="mask_range"), edge="block")
    elif step.ref.mask_token_id is not None and mask_id != step.ref.mask_token_id:
        step.add(Finding("mask_token", "divergence", f"the block's masked slots hold id {mask_id}; "
                         f"{step.ref.mask_source} declares mask_token_id {step.ref.mask_token_id}", mask_id,
                         step.ref.mask_token_id, pitfall=14, key="mask_token_id"), edge="block")


def call_kwarg(step: StepState, call: int, kwarg: str) -> str | None:
    found = [n for n in step.of_role("drafter_kwarg") if step.entries[n].get("kwarg") == kwarg and
             step.entries[n].get("call", call) == call]
    return found[0] if found else None


def block_positions(step: StepState, block: dict, call: int) -> None:
    """The block's position ids (the call's last positions, one per block token): each block's positions run
    on from its anchor's. Where its anchor sits in the data is read by value later, never from these."""
    name = call_kwarg(step, call, "position_ids")
    if name is None:
        return
    positions = step.tensors[name]
    whole = not (positions.is_floating_point() or positions.dtype == torch.bool)
    rows = block["ids"]
    width = rows.shape[-1]
    if not whole or positions.dim() == 0 or positions.shape[-1] < width:
        step.account(name, f"position ids of shape {list(positions.shape)} ({positions.dtype}): not read as the "
                           "blocks' positions")
        return
    step.account(name, f"the drafter's position ids (drafter call {call}): its context's, then the blocks'")
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
                step.add(Finding("positions", "divergence", f"a block's positions are {seen}; the reference "
                                 "places a block at its anchor's position onward", None, None, pitfall=12,
                                 key="block_positions"), edge="block")
    mask = call_kwarg(step, call, "attention_mask")
    if mask is not None:
        block["mask"] = mask


def unread_masks(step: StepState, blocks: Blocks) -> None:
    """A drafter call's attention mask the training-mask check never reached: it needs the blocks' anchors, read
    from the loss's rows (not there without the loss's gradient, or not told from the data). Named for what it
    is, not left unexplained: the missing loss rows are the finding (`loss_rows.py`, `anchors.py`)."""
    for call, block in blocks.calls.items():
        if "mask" in block and block["mask"] not in step.rows:
            step.account(block["mask"], f"the drafter's attention mask (drafter call {call}): not read as the "
                                        "training mask, the blocks' anchors unknown")


def training_mask(step: StepState, mask: torch.Tensor, block: dict, anchors: dict, call: int) -> None:
    """A call holding the whole sequence as context and a hand-built mask: each block sees the context before
    its anchor, strictly, and no other block."""
    name = block["mask"]
    if mask.dim() < 2 or mask.numel() == 0 or mask.shape[-1] < mask.shape[-2]:
        step.account(name, f"an attention mask of shape {list(mask.shape)}, not [queries, context + queries]: "
                           "not read as the training mask")
        return
    visible = mask.reshape(-1, mask.shape[-2], mask.shape[-1])[0]
    if visible.dtype != torch.bool:
        visible = visible > -1  # an additive mask: 0 visible, -inf hidden
    q = visible.shape[0]
    context = visible.shape[1] - q
    width = block["ids"].shape[-1]
    if q != width or context != step.cands.seq_len:
        step.account(name, f"the drafter's attention mask (drafter call {call}; its context is not the whole "
                           "sequence: not read as the training mask)")
        return
    step.account(name, f"the drafter's training mask (drafter call {call})")
    for (b, j), a in sorted(anchors.items()):
        if b != 0:
            continue
        rows = [i for i, s in enumerate(block["slots"][:width]) if s is not None and s[1] == j]
        seen = visible[rows, :context].any(0).nonzero().flatten().tolist()
        if seen != list(range(min(a, context))):
            step.add(Finding("training_mask", "divergence",
                             f"block {j} (anchor at {a}) sees context positions "
                             f"{seen[:3]}...{seen[-1:] if seen else ''}; the reference: every position before "
                             "its anchor, strictly", None, None, pitfall=9, key="context"), edge="block")
            return
        other = visible[rows, context:].clone()
        other[:, rows] = False
        if other.any():
            step.add(Finding("training_mask", "divergence", f"block {j}'s queries see another block's "
                             "tokens; the reference lets a block see only itself", None, None, pitfall=9,
                             key="cross_block"), edge="block")
            return


def same_rows(fed: torch.Tensor, embedded: torch.Tensor) -> bool:
    """The same embedding rows in any layout: `[n]` ids embedded, then fed as `[1, n, H]` or `[blocks, B, H]`."""
    return fed.numel() == embedded.numel() and fed.shape[-1:] == embedded.shape[-1:]
