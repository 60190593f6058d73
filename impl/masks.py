"""Attention masks of the drafter, as dense boolean tensors (True = may attend).

Training (speculators' anchor-block layout): queries are `A` blocks of `B` slots, one
block per anchor; keys are `[packed base sequence (T) | all blocks (A*B)]`.
Inference (z-lab's loop): queries are one block; keys are `[context | block]`.
"""

from __future__ import annotations

import torch


def training_mask(document_ids: torch.Tensor, anchors: torch.Tensor, block_size: int,
                  sliding_window: int | None = None, causal_block: bool = False) -> torch.Tensor:
    """[A*B, T + A*B] mask for the anchor blocks.

    A query of block j (anchor a_j) sees base tokens of its own document (id != -1) at
    positions strictly before a_j (and >= a_j - window on sliding layers), plus its own
    block: all of it, or only earlier-or-equal slots when `causal_block`. Never another block.

    Every slot of a block shares its anchor's base row, so the [A, T] rows are built once and
    copied B times into the one output (no [A*B, T] temporaries, no concatenation): at T = 16k
    with 512 anchors of 16 the mask is 201 MB and its construction needs little more.
    """
    document_ids = document_ids.reshape(-1)
    anchors = anchors.reshape(-1).long()
    total, count = document_ids.numel(), anchors.numel()
    slots = count * block_size
    out = torch.empty(slots, total + slots, dtype=torch.bool, device=anchors.device)
    base_pos = torch.arange(total, device=anchors.device)[None, :]  # [1, T]
    anchor_doc = document_ids[anchors][:, None]  # [A, 1]
    rows = (anchor_doc == document_ids[None, :]) & (base_pos < anchors[:, None])  # [A, T]
    rows &= anchor_doc != -1
    if sliding_window is not None:
        rows &= base_pos >= anchors[:, None] - sliding_window
    out[:, :total].view(count, block_size, total).copy_(rows[:, None, :].expand(count, block_size, total))
    blocks = out[:, total:].view(count, block_size, count, block_size)
    blocks.zero_()
    own = torch.ones(block_size, block_size, dtype=torch.bool, device=anchors.device)
    if causal_block:
        own = own.tril()
    torch.diagonal(blocks, dim1=0, dim2=2).copy_(own[:, :, None].expand(block_size, block_size, count))
    return out


def within_window(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor | bool:
    """z-lab's sliding-window rule at inference: key k is visible to query q when q - k < window."""
    return True if window is None else q_pos - k_pos < window


def inference_mask(context_len: int, block_len: int, sliding_window: int | None = None,
                   causal: bool = False, device: torch.device | None = None) -> torch.Tensor:
    """[block_len, context_len + block_len] mask for one decoding block.

    Full layers see all context and the whole block. Sliding layers (z-lab 0.1.0) are
    causal within the block and windowed: key k is visible to query q when q - k < window.
    """
    kv_len = context_len + block_len
    q_pos = (context_len + torch.arange(block_len, device=device))[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    visible = torch.ones(block_len, kv_len, dtype=torch.bool, device=device)
    if causal:
        visible &= k_pos <= q_pos
    if sliding_window is not None:
        visible &= within_window(q_pos, k_pos, sliding_window)
        if not causal:
            visible &= k_pos - q_pos < sliding_window
    return visible
